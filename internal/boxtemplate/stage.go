package boxtemplate

import (
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"

	"golang.org/x/sys/unix"
)

// Stage is a template being made: a hidden directory in the store whose
// files directory the setup's box writes into, then Commit seals it and
// moves it into place, or Abort removes it.
type Stage struct {
	store *Store
	name  string
	dir   string
}

// Stage starts making template name. Its files directory belongs to
// whoever runs kiln, mode 0700, until the backend that runs the setup
// hands it to the setup box's user (HandTo): no one else can write there,
// even knowing its host path, which every box's mountinfo prints. The
// stage's own directory is not listable by others (boxes' inits must
// pass through it to bind the files), and its name holds 128 random bits.
func (s *Store) Stage(name string) (*Stage, error) {
	if err := ValidName(name); err != nil {
		return nil, err
	}
	if _, err := os.Lstat(filepath.Join(s.Dir, name)); err == nil {
		return nil, fmt.Errorf("template %q: %w (remove it first: kiln template rm %s)", name, ErrExists, name)
	}
	var rnd [16]byte
	rand.Read(rnd[:])
	dir := filepath.Join(s.Dir, ".new-"+name+"-"+hex.EncodeToString(rnd[:]))
	if err := os.Mkdir(dir, 0o700); err != nil {
		return nil, err
	}
	err := os.Chmod(dir, 0o711)
	if err == nil {
		err = os.Mkdir(filepath.Join(dir, FilesName), 0o700)
	}
	if err != nil {
		os.RemoveAll(dir)
		return nil, fmt.Errorf("creating the template's stage: %w", err)
	}
	return &Stage{store: s, name: name, dir: dir}, nil
}

// HandTo gives the stage's files directory to the host user a setup's box
// runs as (uid, gid), mode 0700: the backend calls it before the box
// starts, so that box alone writes there. It changes the directory it
// opened, never what a path resolves to later.
func HandTo(files string, uid, gid int) error {
	fd, err := unix.Open(files, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("handing the template's stage to its setup: %w", err)
	}
	defer unix.Close(fd)
	if err := unix.Fchown(fd, uid, gid); err != nil {
		return fmt.Errorf("handing the template's stage to its setup: %w", err)
	}
	if err := unix.Fchmod(fd, 0o700); err != nil {
		return fmt.Errorf("handing the template's stage to its setup: %w", err)
	}
	return nil
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

// afterStat, when a test sets it, runs between seal's look at an entry
// and its change of it: where a swap would race.
var afterStat func(path string)

// seal makes what the setup wrote the host's: every file and directory
// belongs to whoever runs kiln (the host's root) and nobody else may
// change it; directories and files are readable by all (boxes run as
// unprivileged host uids), and set-id bits are cleared. Only regular
// files, directories and symbolic links may be in a template (a symbolic
// link is never followed here, and resolves inside a box). A regular file
// with other hard links is refused: its other name could be a host file,
// which sealing would change.
//
// Every change is made through a descriptor opened without following a
// symbolic link, relative to its parent's descriptor, and checked to be
// the entry that was looked at: an entry swapped meanwhile (for a link to
// a host file, say) is refused, never followed.
func seal(root string) (files int, bytes int64, err error) {
	fd, err := unix.Open(root, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return 0, 0, err
	}
	sl := sealer{uid: os.Geteuid(), gid: os.Getegid()}
	err = sl.dir(fd, root, ".")
	return sl.files, sl.bytes, err
}

type sealer struct {
	uid, gid int
	files    int
	bytes    int64
}

// dir seals the directory open on fd (which it closes) and what is in it.
func (sl *sealer) dir(fd int, path, rel string) error {
	d := os.NewFile(uintptr(fd), path)
	defer d.Close()
	names, err := d.Readdirnames(-1)
	if err != nil {
		return err
	}
	for _, name := range names {
		if err := sl.entry(fd, filepath.Join(path, name), filepath.Join(rel, name), name); err != nil {
			return err
		}
	}
	if err := unix.Fchown(fd, sl.uid, sl.gid); err != nil {
		return err
	}
	return unix.Fchmod(fd, 0o755)
}

func (sl *sealer) entry(parent int, path, rel, name string) error {
	var seen unix.Stat_t
	if err := unix.Fstatat(parent, name, &seen, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return err
	}
	if afterStat != nil {
		afterStat(path)
	}
	switch seen.Mode & unix.S_IFMT {
	case unix.S_IFLNK:
		return unix.Fchownat(parent, name, sl.uid, sl.gid, unix.AT_SYMLINK_NOFOLLOW)
	case unix.S_IFDIR, unix.S_IFREG:
	default:
		return fmt.Errorf("%s is a %s; a template holds only files, directories and symbolic links", rel, fs.FileMode(seen.Mode&unix.S_IFMT).Type())
	}
	flags := unix.O_RDONLY | unix.O_NOFOLLOW | unix.O_NONBLOCK | unix.O_NOCTTY | unix.O_CLOEXEC
	if seen.Mode&unix.S_IFMT == unix.S_IFDIR {
		flags |= unix.O_DIRECTORY
	}
	fd, err := unix.Openat(parent, name, flags, 0)
	if err != nil {
		return fmt.Errorf("%s changed while it was sealed: %w", rel, err)
	}
	var now unix.Stat_t
	if err := unix.Fstat(fd, &now); err != nil {
		unix.Close(fd)
		return err
	}
	if now.Dev != seen.Dev || now.Ino != seen.Ino || now.Mode&unix.S_IFMT != seen.Mode&unix.S_IFMT {
		unix.Close(fd)
		return fmt.Errorf("%s changed while it was sealed", rel)
	}
	if now.Mode&unix.S_IFMT == unix.S_IFDIR {
		return sl.dir(fd, path, rel)
	}
	defer unix.Close(fd)
	if now.Nlink > 1 {
		return fmt.Errorf("%s has %d hard links; a template holds only files of its own", rel, now.Nlink)
	}
	if err := unix.Fchown(fd, sl.uid, sl.gid); err != nil {
		return err
	}
	perm := uint32(0o644)
	if now.Mode&0o111 != 0 {
		perm = 0o755
	}
	sl.files++
	sl.bytes += now.Size
	return unix.Fchmod(fd, perm)
}
