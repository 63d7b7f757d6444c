//go:build !linux

package agent

import "errors"

var errCodeSetup = errors.New("setting code's limits is not supported on this OS")

func rlimitResource(name string) (int, bool) {
	switch name {
	case "RLIMIT_CORE", "RLIMIT_NOFILE", "RLIMIT_NPROC":
		return 0, true
	}
	return 0, false
}

func applyCodeSetup(s CodeSetup) error {
	if s.empty() {
		return nil
	}
	return errCodeSetup
}

func execve(path string, argv, env []string) error { return errCodeSetup }
