//go:build !linux

package agent

import "errors"

var errCodeSetup = errors.New("setting code's limits is not supported on this OS")

func applyCodeSetup(s CodeSetup) error {
	if s.empty() {
		return nil
	}
	return errCodeSetup
}

func execve(path string, argv, env []string) error { return errCodeSetup }
