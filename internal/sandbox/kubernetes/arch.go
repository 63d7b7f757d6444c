package kubernetes

import (
	"runtime"

	specs "github.com/opencontainers/runtime-spec/specs-go"
)

// nativeArch is the seccomp architecture of the nodes kiln expects: its
// own.
func nativeArch() specs.Arch {
	if runtime.GOARCH == "arm64" {
		return specs.ArchAARCH64
	}
	return specs.ArchX86_64
}
