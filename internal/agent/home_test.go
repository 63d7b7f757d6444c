package agent

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
)

// TestChildEnvHomeOutsideWorkspace: code's HOME is box-private and outside
// the workspace whether the agent's own HOME is unset, "/" (a microVM
// kernel's init) or the workspace; a backend's own choice is kept.
func TestChildEnvHomeOutsideWorkspace(t *testing.T) {
	t.Setenv("XDG_CACHE_HOME", "")
	os.Unsetenv("XDG_CACHE_HOME")
	for _, tc := range []struct{ home, want string }{
		{"", "/tmp/home"}, {"/", "/tmp/home"}, {"/work", "/tmp/home"}, {"/tmp/elsewhere", "/tmp/elsewhere"},
	} {
		t.Setenv("HOME", tc.home)
		if tc.home == "" {
			os.Unsetenv("HOME")
		}
		env := childEnv(&Config{Workspace: "/work"})
		var homes []string
		for _, kv := range env {
			if strings.HasPrefix(kv, "HOME=") {
				homes = append(homes, kv)
			}
		}
		if len(homes) != 1 || homes[0] != "HOME="+tc.want || !slices.Contains(env, "XDG_CACHE_HOME=/tmp/home/.cache") {
			t.Errorf("agent HOME %q: child gets %v and XDG_CACHE_HOME? %v", tc.home, homes, slices.Contains(env, "XDG_CACHE_HOME=/tmp/home/.cache"))
		}
	}
}

func TestMakeHome(t *testing.T) {
	dir := t.TempDir()
	home := filepath.Join(dir, "home")
	t.Setenv("HOME", home)
	makeHome(&Config{Workspace: "/work", UID: -1, GID: -1})
	st, err := os.Stat(home)
	if err != nil {
		t.Fatal(err)
	}
	if st.Mode().Perm() != 0o700 || !st.IsDir() {
		t.Errorf("HOME is %v, want a directory of mode 0700", st.Mode())
	}
	// A symlink in HOME's place is left alone, never followed.
	target := filepath.Join(dir, "elsewhere")
	os.Mkdir(target, 0o755)
	link := filepath.Join(dir, "link")
	os.Symlink(target, link)
	t.Setenv("HOME", link)
	makeHome(&Config{Workspace: "/work", UID: 12345, GID: 12345})
	st, err = os.Stat(target)
	if err != nil {
		t.Fatal(err)
	}
	if st.Mode().Perm() != 0o755 || int(st.Sys().(*syscall.Stat_t).Uid) == 12345 {
		t.Errorf("makeHome changed the symlink's target: %v", st.Mode())
	}
}
