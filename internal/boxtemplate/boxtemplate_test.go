package boxtemplate_test

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"kiln/internal/boxtemplate"
)

func store(t *testing.T) *boxtemplate.Store {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "templates")
	for d := filepath.Dir(dir); d != "/tmp" && d != "/"; d = filepath.Dir(d) {
		os.Chmod(d, 0o755) // checkReachable, when root
	}
	s, err := boxtemplate.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func TestValidName(t *testing.T) {
	for _, ok := range []string{"t", "data-1", "py3.11_pandas"} {
		if err := boxtemplate.ValidName(ok); err != nil {
			t.Errorf("%q: %v", ok, err)
		}
	}
	for _, bad := range []string{"", ".", "..", "a/b", "../x", "A", "-x", ".hidden", "a..b", strings.Repeat("a", 64), "a b", "é"} {
		if err := boxtemplate.ValidName(bad); err == nil {
			t.Errorf("%q accepted", bad)
		}
	}
}

func TestCommitLoadListRemove(t *testing.T) {
	s := store(t)
	st, err := s.Stage("t1")
	if err != nil {
		t.Fatal(err)
	}
	if fi, _ := os.Stat(st.Files()); fi.Mode().Perm() != 0o700 {
		t.Errorf("stage files dir mode %v, want 0700 until the setup's box is handed it", fi.Mode().Perm())
	}
	os.MkdirAll(filepath.Join(st.Files(), "python", "pkg"), 0o777)
	os.WriteFile(filepath.Join(st.Files(), "python", "pkg", "__init__.py"), []byte("X = 1\n"), 0o666)
	os.WriteFile(filepath.Join(st.Files(), "tool"), []byte("#!/bin/sh\n"), 0o4777)
	os.Chmod(filepath.Join(st.Files(), "tool"), 0o4777)
	os.Symlink("/etc/shadow", filepath.Join(st.Files(), "link"))
	tpl, err := st.Commit(boxtemplate.Manifest{KilnVersion: "v1", Backend: "jail", Setup: "setup.sh", Import: []string{"pkg"}})
	if err != nil {
		t.Fatal(err)
	}
	if tpl.Files != 2 || tpl.Bytes != int64(len("X = 1\n")+len("#!/bin/sh\n")) {
		t.Errorf("files %d bytes %d", tpl.Files, tpl.Bytes)
	}
	for name, want := range map[string]os.FileMode{"python": 0o755, "python/pkg/__init__.py": 0o644, "tool": 0o755} {
		fi, err := os.Lstat(filepath.Join(tpl.FilesDir(), name))
		if err != nil {
			t.Fatal(err)
		}
		if fi.Mode()&(os.ModePerm|os.ModeSetuid|os.ModeSetgid) != want {
			t.Errorf("%s: mode %v, want %v", name, fi.Mode(), want)
		}
		if s := fi.Sys().(*syscall.Stat_t); int(s.Uid) != os.Geteuid() {
			t.Errorf("%s: owner %d", name, s.Uid)
		}
	}
	if target, _ := os.Readlink(filepath.Join(tpl.FilesDir(), "link")); target != "/etc/shadow" {
		t.Errorf("symlink became %q", target)
	}
	if fi, _ := os.Stat("/etc/shadow"); fi != nil && fi.Mode().Perm()&0o004 != 0 {
		t.Errorf("sealing followed the symlink: /etc/shadow is %v", fi.Mode())
	}

	got, err := s.Load("t1", "v1", "jail")
	if err != nil {
		t.Fatal(err)
	}
	if got.Name != "t1" || got.Format != boxtemplate.Format || len(got.Import) != 1 || got.FilesDir() != filepath.Join(s.Dir, "t1", "files") {
		t.Errorf("loaded %+v", got)
	}
	if _, err := s.Load("t1", "v2", "jail"); !errors.Is(err, boxtemplate.ErrMismatch) || !strings.Contains(err.Error(), "kiln v1") {
		t.Errorf("other kiln version: %v", err)
	}
	if _, err := s.Load("t1", "v1", "gvisor"); !errors.Is(err, boxtemplate.ErrMismatch) || !strings.Contains(err.Error(), "jail backend") {
		t.Errorf("other backend: %v", err)
	}
	if _, err := s.Load("nope", "v1", "jail"); !errors.Is(err, boxtemplate.ErrNotFound) {
		t.Errorf("unknown template: %v", err)
	}
	if _, err := s.Stage("t1"); !errors.Is(err, boxtemplate.ErrExists) {
		t.Errorf("staging an existing name: %v", err)
	}
	list, err := s.List()
	if err != nil || len(list) != 1 || list[0].Name != "t1" || list[0].Err != nil {
		t.Errorf("List: %+v, %v", list, err)
	}
	if err := s.Remove("t1"); err != nil {
		t.Fatal(err)
	}
	if err := s.Remove("t1"); !errors.Is(err, boxtemplate.ErrNotFound) {
		t.Errorf("removing twice: %v", err)
	}
	if entries, _ := os.ReadDir(s.Dir); len(entries) != 0 {
		t.Errorf("left behind: %v", entries)
	}
}

func TestCorruptManifest(t *testing.T) {
	s := store(t)
	for name, manifest := range map[string]string{
		"trunc":  `{"format": "kiln-templ`,
		"format": `{"format": "kiln-template/9", "name": "format"}`,
		"named":  `{"format": "kiln-template/1", "name": "other"}`,
	} {
		os.MkdirAll(filepath.Join(s.Dir, name, "files"), 0o755)
		os.WriteFile(filepath.Join(s.Dir, name, "manifest.json"), []byte(manifest), 0o644)
		if _, err := s.Load(name, "v1", "jail"); err == nil {
			t.Errorf("%s: loaded", name)
		}
	}
	list, _ := s.List()
	for _, l := range list {
		if l.Err == nil {
			t.Errorf("%s listed as good", l.Name)
		}
	}
}

// TestSealRefuses: what a setup leaves that a template must not hold.
func TestSealRefuses(t *testing.T) {
	for name, make := range map[string]func(dir string) error{
		"fifo": func(dir string) error { return syscall.Mkfifo(filepath.Join(dir, "f"), 0o666) },
		"hard link": func(dir string) error {
			outside := filepath.Join(filepath.Dir(dir), "outside")
			os.WriteFile(outside, []byte("host file"), 0o600)
			return os.Link(outside, filepath.Join(dir, "l"))
		},
	} {
		t.Run(name, func(t *testing.T) {
			s := store(t)
			st, err := s.Stage("t")
			if err != nil {
				t.Fatal(err)
			}
			defer st.Abort()
			if err := make(st.Files()); err != nil {
				t.Fatal(err)
			}
			if _, err := st.Commit(boxtemplate.Manifest{}); err == nil {
				t.Error("committed")
			}
			if _, err := s.Load("t", "", ""); !errors.Is(err, boxtemplate.ErrNotFound) {
				t.Errorf("a refused template is there: %v", err)
			}
		})
	}
}

// TestSweep: Open removes what killed commands left, and no fresh stage.
func TestSweep(t *testing.T) {
	s := store(t)
	old, err := s.Stage("old")
	if err != nil {
		t.Fatal(err)
	}
	past := time.Now().Add(-72 * time.Hour)
	stageDir := filepath.Dir(old.Files())
	os.Chtimes(stageDir, past, past)
	fresh, err := s.Stage("fresh")
	if err != nil {
		t.Fatal(err)
	}
	os.MkdirAll(filepath.Join(s.Dir, ".rm-x-1", "x"), 0o755)
	if _, err := boxtemplate.Open(s.Dir); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(stageDir); err == nil {
		t.Error("an old stage survived")
	}
	if _, err := os.Stat(fresh.Files()); err != nil {
		t.Errorf("a fresh stage was removed: %v", err)
	}
	if _, err := os.Stat(filepath.Join(s.Dir, ".rm-x-1")); err == nil {
		t.Error("a removal's leftover survived")
	}
}
