package jail

// The jail's security policy, as data. Each table has a test that runs a
// victim inside a box and sees it refused (jail_test.go, sandboxtest).

// runtimeDirs are the host directories bound read-only into every box: the
// interpreter and its libraries, nothing else. A host symlink (merged /usr)
// is recreated as the same symlink.
var runtimeDirs = []string{"/usr", "/lib", "/lib64", "/lib32", "/libx32", "/bin", "/sbin"}

// etcFromHost are harmless host files under /etc that the runtime needs,
// bound read-only: the dynamic loader's cache, the alternatives that
// numpy's BLAS goes through, fonts and matplotlib's defaults, CA
// certificates for HTTPS under an egress allowlist. Never passwd, shadow,
// hosts or anything with secrets: those are synthesized (etcFiles).
var etcFromHost = []string{
	"/etc/ld.so.cache",
	"/etc/ld.so.conf",
	"/etc/ld.so.conf.d",
	"/etc/alternatives",
	"/etc/fonts",
	"/etc/matplotlibrc",
	"/etc/localtime",
	"/etc/mime.types",
	"/etc/ssl/certs",
	"/etc/ca-certificates.conf",
	"/etc/python3",
	"/etc/python3.11",
	"/etc/python3.12",
	"/etc/python3.13",
	"/etc/bash.bashrc",
	"/etc/inputrc",
}

// boxUID and boxGID are the unprivileged user code runs as, inside the box.
// On the host they map to a range no real user has (see uidBase).
const (
	boxUID  = 1000
	boxGID  = 1000
	boxUser = "sandbox"
)

// etcFiles are synthesized for every box.
func etcFiles(hostname, resolvConf string) map[string]string {
	return map[string]string{
		"passwd":        "root:x:0:0:root:/root:/usr/sbin/nologin\nsandbox:x:1000:1000:sandbox:/work:/bin/bash\nnobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n",
		"group":         "root:x:0:\nsandbox:x:1000:\nnogroup:x:65534:\n",
		"hosts":         "127.0.0.1\tlocalhost " + hostname + "\n::1\tlocalhost ip6-localhost\n",
		"hostname":      hostname + "\n",
		"resolv.conf":   resolvConf,
		"nsswitch.conf": "passwd: files\ngroup: files\nhosts: files dns\n",
	}
}

// devNodes are bound from the host's /dev into the box's small /dev.
var devNodes = []string{"null", "zero", "full", "random", "urandom"}

// The syscall policy (denied syscalls, clone namespace flags, AF_PACKET) is
// shared with the other backends: sandbox.DeniedSyscalls and its neighbours
// in internal/sandbox/policy.go, loaded by seccompFilter.
