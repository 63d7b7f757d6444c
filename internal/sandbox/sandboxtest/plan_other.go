//go:build !linux

package sandboxtest

// syscallNumbers are known on linux only: the seccomp check skips its
// probes elsewhere.
var syscallNumbers = map[string]int{}
