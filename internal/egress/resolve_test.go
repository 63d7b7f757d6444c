package egress

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"kiln/internal/config"
)

// TestHostsFileTrusted: the hosts file decides where an allowed name
// goes, so it is checked as the configuration file is: a file its group
// or others can write, or of a user other than root and kiln's, is
// refused, naming the fix.
func TestHostsFileTrusted(t *testing.T) {
	load := func(mode os.FileMode, uid int) error {
		t.Helper()
		p := filepath.Join(t.TempDir(), "hosts")
		if err := os.WriteFile(p, []byte("192.0.2.7 web.test\n"), 0o600); err != nil {
			t.Fatal(err)
		}
		os.Chmod(p, mode)
		if uid >= 0 {
			if err := os.Chown(p, uid, uid); err != nil {
				t.Fatal(err)
			}
		}
		_, err := newResolver(Options{HostsFile: p})
		return err
	}
	if err := load(0o644, -1); err != nil {
		t.Fatalf("a 0644 hosts file of kiln's user: %v", err)
	}
	for _, mode := range []os.FileMode{0o666, 0o664, 0o646} {
		if err := load(mode, -1); !errors.Is(err, config.ErrUnsafeFile) || !strings.Contains(err.Error(), "chmod") {
			t.Errorf("a hosts file of mode %04o: err = %v, want ErrUnsafeFile saying chmod", mode, err)
		}
	}
	if os.Geteuid() != 0 {
		t.Skip("giving a file to another uid needs root")
	}
	if err := load(0o644, 4242); !errors.Is(err, config.ErrUnsafeFile) || !strings.Contains(err.Error(), "uid 4242") {
		t.Errorf("a hosts file of uid 4242: err = %v, want ErrUnsafeFile naming the uid", err)
	}
}
