package boxtemplate

import (
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"syscall"
)

// Stage is a template being made: a hidden directory in the store whose
// files directory the setup's box writes into, then Commit seals it and
// moves it into place, or Abort removes it.
type Stage struct {
	store *Store
	name  string
	dir   string
}

// Stage starts making template name. Its files directory is writable by
// anyone while the setup runs (the setup's box user is a host uid picked
// per box); the stage's own directory is not listable by them, and its
// name holds 128 random bits.
func (s *Store) Stage(name string) (*Stage, error) {
	if err := ValidName(name); err != nil {
		return nil, err
	}
	if _, err := os.Lstat(filepath.Join(s.Dir, name)); err == nil {
		return nil, fmt.Errorf("template %q: %w (remove it first: kiln template rm %s)", name, ErrExists, name)
	}
	// A name no one can guess: the files directory is writable by all
	// while the setup runs, and other host users may pass through the
	// store (never list it).
	var rnd [16]byte
	rand.Read(rnd[:])
	dir := filepath.Join(s.Dir, ".new-"+name+"-"+hex.EncodeToString(rnd[:]))
	if err := os.Mkdir(dir, 0o700); err != nil {
		return nil, err
	}
	files := filepath.Join(dir, FilesName)
	err := os.Chmod(dir, 0o711)
	if err == nil {
		if err = os.Mkdir(files, 0o777); err == nil {
			err = os.Chmod(files, 0o777) // past the umask
		}
	}
	if err != nil {
		os.RemoveAll(dir)
		return nil, fmt.Errorf("creating the template's stage: %w", err)
	}
	return &Stage{store: s, name: name, dir: dir}, nil
}

// Files is the directory the setup writes into.
func (st *Stage) Files() string { return filepath.Join(st.dir, FilesName) }

// Abort removes the stage.
func (st *Stage) Abort() error { return os.RemoveAll(st.dir) }

// Commit seals the files (see seal), writes the manifest, filling in its
// name, format, size and count, and moves the template into place.
func (st *Stage) Commit(m Manifest) (*Template, error) {
	files, bytes, err := seal(st.Files())
	if err != nil {
		return nil, fmt.Errorf("sealing the template's files: %w", err)
	}
	if err := os.Chmod(st.Files(), 0o755); err != nil {
		return nil, err
	}
	m.Format, m.Name, m.Files, m.Bytes = Format, st.name, files, bytes
	raw, err := json.MarshalIndent(&m, "", "  ")
	if err != nil {
		return nil, err
	}
	if err := os.WriteFile(filepath.Join(st.dir, ManifestName), append(raw, '\n'), 0o644); err != nil {
		return nil, err
	}
	if err := os.Chmod(st.dir, 0o755); err != nil {
		return nil, err
	}
	dst := filepath.Join(st.store.Dir, st.name)
	if _, err := os.Lstat(dst); err == nil {
		return nil, fmt.Errorf("template %q: %w (made meanwhile)", st.name, ErrExists)
	}
	if err := os.Rename(st.dir, dst); err != nil {
		return nil, fmt.Errorf("moving the template into place: %w", err)
	}
	return &Template{Manifest: m, Dir: dst}, nil
}

// seal makes what the setup wrote the host's: every file and directory
// belongs to whoever runs kiln (the host's root) and nobody else may change it; directories
// and files are readable by all (boxes run as unprivileged host uids), and
// set-id bits are cleared. Only regular files, directories and symbolic
// links may be in a template (a symbolic link is never followed here, and
// resolves inside a box). A regular file with other hard links is refused:
// its other name could be a host file, which sealing would change.
//
// The setup's box is gone when seal runs, so nothing changes the tree
// under it.
func seal(root string) (files int, bytes int64, err error) {
	uid, gid := os.Geteuid(), os.Getegid()
	err = filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		info, err := d.Info()
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, p)
		mode := info.Mode()
		switch {
		case mode.IsDir():
			if err := os.Lchown(p, uid, gid); err != nil {
				return err
			}
			return os.Chmod(p, 0o755)
		case mode&fs.ModeSymlink != 0:
			return os.Lchown(p, uid, gid)
		case mode.IsRegular():
			if s, ok := info.Sys().(*syscall.Stat_t); ok && s.Nlink > 1 {
				return fmt.Errorf("%s has %d hard links; a template holds only files of its own", rel, s.Nlink)
			}
			if err := os.Lchown(p, uid, gid); err != nil {
				return err
			}
			perm := fs.FileMode(0o644)
			if mode&0o111 != 0 {
				perm = 0o755
			}
			files++
			bytes += info.Size()
			return os.Chmod(p, perm)
		default:
			return fmt.Errorf("%s is a %s; a template holds only files, directories and symbolic links", rel, mode.Type())
		}
	})
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return 0, 0, err
	}
	return files, bytes, err
}
