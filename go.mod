module kiln

go 1.26.8

require (
	github.com/elastic/go-seccomp-bpf v1.6.0 // indirect
	github.com/google/go-cmp v0.7.0 // indirect
	github.com/landlock-lsm/go-landlock v0.11.2 // indirect
	github.com/modelcontextprotocol/go-sdk v1.8.0 // indirect
	golang.org/x/net v0.41.0 // indirect
	golang.org/x/sys v0.50.0 // indirect
)
