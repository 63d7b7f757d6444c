package jail

import (
	"fmt"
	"path/filepath"
	"slices"

	"golang.org/x/sys/unix"
)

// ZygoteInitArg is the hidden first argument with which kiln re-executes
// itself as a zygote template's init: it builds the template's root like a
// box's, in its own mount, pid, network, ipc and uts namespaces but in the
// host's user namespace, becomes the unprivileged host uid uidBase holding
// only templateCaps (forks need them to become their box's host uid and to
// get their id maps) and execs kiln-agent -zygote, which becomes the
// template's python.
const ZygoteInitArg = "__kiln_jail_zygote"

// runZygoteInit is the template's init. fd 3 carries the config, fd 4 the
// executable, fd 5 the control socket, which the template gets on fd 3.
func runZygoteInit() error {
	cfg, err := prepare([]initStep{
		{"building root", buildRoot},
		{"unmasking /proc", unmaskProc},
		{"entering root", enterRoot},
	})
	if err != nil {
		return err
	}
	if err := unix.Setrlimit(unix.RLIMIT_CORE, &unix.Rlimit{}); err != nil {
		return fmt.Errorf("setting limits: %w", err)
	}
	if err := unix.Dup2(5, 3); err != nil {
		return fmt.Errorf("placing control socket: %w", err)
	}
	unix.Close(5)
	if err := becomeTemplateUser(cfg); err != nil {
		return fmt.Errorf("becoming the template user: %w", err)
	}
	return execAgent(cfg)
}

// unmaskProc takes the masks off the template's /proc: a box's fresh
// /proc, mounted in its own user namespace, is only allowed where a fully
// visible one exists. No model code ever runs in the template; every box
// masks its own /proc again.
func unmaskProc(cfg *initConfig) error {
	proc := filepath.Join(cfg.Root, "proc")
	for _, p := range append(slices.Clone(cfg.Plan.ProcMasks), "sys") {
		if err := unix.Unmount(filepath.Join(proc, p), unix.MNT_DETACH); err != nil && err != unix.EINVAL && err != unix.ENOENT {
			return fmt.Errorf("unmounting %s: %w", p, err)
		}
	}
	return nil
}
