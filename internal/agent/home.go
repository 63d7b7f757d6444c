package agent

import (
	"os"
	"syscall"

	"kiln/internal/boxpolicy"
)

// Every backend gives code a box-private HOME outside the workspace, so
// that what tools keep under ~ and in their caches (fontconfig, pip,
// matplotlib, shells' histories) never comes back as files the code made.
// The box plan names it (boxpolicy.Home); backends that start the agent with
// an environment set the same value.
const boxHome = boxpolicy.Home

// homeOf is the code's HOME: the agent's own, unless that is unset, "/"
// (what a kernel gives init, in a microVM) or the workspace; then boxHome.
func homeOf(cfg *Config) string {
	switch h := os.Getenv("HOME"); {
	case h == "" || h == "/" || h == cfg.Workspace || h[0] != '/':
		return boxHome
	default:
		return h
	}
}

// makeHome creates the code's HOME when it does not exist yet: mode 0700,
// owned by the code's user when the agent runs code as another user. It
// runs before any code does. An existing HOME, or a symlink in its place,
// is left as it is.
func makeHome(cfg *Config) {
	home := homeOf(cfg)
	if err := os.Mkdir(home, 0o700); err != nil {
		return
	}
	// Through the descriptor, never the name: nothing can swap the path.
	f, err := os.OpenFile(home, os.O_RDONLY|syscall.O_DIRECTORY|syscall.O_NOFOLLOW, 0)
	if err != nil {
		return
	}
	defer f.Close()
	f.Chmod(0o700) // whatever the umask
	if cfg.UID >= 0 && cfg.UID != os.Getuid() {
		f.Chown(cfg.UID, cfg.GID)
	}
}
