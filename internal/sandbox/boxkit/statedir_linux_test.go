package boxkit

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestOwnDirRefusesWhatIsNotMine: a state dir that is a symbolic link, a
// file, or another user's directory is refused with an error that names
// it; a missing one is made with the mode asked for.
func TestOwnDirRefusesWhatIsNotMine(t *testing.T) {
	base := t.TempDir()
	fresh := filepath.Join(base, "fresh")
	if err := OwnDir(fresh, 0o711); err != nil {
		t.Fatal(err)
	}
	if fi, err := os.Stat(fresh); err != nil || fi.Mode().Perm() != 0o711 {
		t.Errorf("made %v %v, want mode 0711", fi, err)
	}
	link := filepath.Join(base, "link")
	if err := os.Symlink(fresh, link); err != nil {
		t.Fatal(err)
	}
	file := filepath.Join(base, "file")
	os.WriteFile(file, nil, 0o600)
	for _, p := range []string{link, file} {
		if err := OwnDir(p, 0o711); err == nil || !strings.Contains(err.Error(), p) {
			t.Errorf("OwnDir(%s) = %v, want a refusal that names it", p, err)
		}
	}
	if os.Getuid() == 0 {
		other := filepath.Join(base, "other")
		os.Mkdir(other, 0o777)
		if err := os.Chown(other, 4242, 4242); err != nil {
			t.Fatal(err)
		}
		if err := OwnDir(other, 0o711); err == nil || !strings.Contains(err.Error(), "uid 4242") {
			t.Errorf("another user's directory: %v, want a refusal naming its owner", err)
		}
	}
}
