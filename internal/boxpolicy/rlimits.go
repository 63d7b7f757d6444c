package boxpolicy

// rlimitResources are the Linux resource numbers (asm-generic/resource.h,
// which x86 and arm64 use) of the rlimits a plan may name: the one table
// every reader of a plan's Rlimits goes through (the jail's init and
// zygote, the microVM guest, the agent's -code-rlimits). A name outside it
// is refused, never guessed.
var rlimitResources = map[string]int{
	"RLIMIT_CORE":   4,
	"RLIMIT_NOFILE": 7,
	"RLIMIT_NPROC":  6,
}

// RlimitResource is the Linux resource number of the rlimit named name
// ("RLIMIT_NOFILE"), and whether a plan may name it.
func RlimitResource(name string) (int, bool) {
	r, ok := rlimitResources[name]
	return r, ok
}
