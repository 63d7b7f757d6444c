package audit

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"strconv"
	"syscall"

	"kiln/internal/config"
)

// rotator is an append-only file rotated by size: past max bytes the file
// becomes path.1, earlier ones shift up to path.keep, and writing goes on
// in a new file. A record is never split across two files.
type rotator struct {
	path string
	max  int64 // < 0: never rotate
	keep int   // < 0: keep none
	f    *os.File
	size int64
}

func openRotator(path string, max int64, keep int) (*rotator, error) {
	r := &rotator{path: path, max: max, keep: keep}
	if err := r.open(); err != nil {
		return nil, err
	}
	return r, nil
}

// open opens the log for appending, creating it owner-only. It follows no
// symbolic link, refuses anything but a regular file, and makes an
// existing file owner-only too.
func (r *rotator) open() error {
	f, err := os.OpenFile(r.path, os.O_WRONLY|os.O_APPEND|os.O_CREATE|syscall.O_NOFOLLOW|syscall.O_CLOEXEC, 0o600)
	if err != nil {
		return fmt.Errorf("opening the audit log: %w", err)
	}
	st, err := f.Stat()
	if err != nil {
		f.Close()
		return fmt.Errorf("opening the audit log: %w", err)
	}
	if !st.Mode().IsRegular() {
		f.Close()
		return fmt.Errorf("opening the audit log: %s is not a regular file", r.path)
	}
	// Its owner could rewrite the records, whatever the mode set below.
	if err := config.CheckOwner("audit log", r.path, st); err != nil {
		f.Close()
		return err
	}
	if st.Mode().Perm() != 0o600 {
		if err := f.Chmod(0o600); err != nil {
			f.Close()
			return fmt.Errorf("making the audit log owner-only: %w", err)
		}
	}
	r.f, r.size = f, st.Size()
	return nil
}

func (r *rotator) write(line []byte) error {
	if r.f == nil { // a rotation failed to open the new file: try again
		if err := r.open(); err != nil {
			return err
		}
	}
	if r.max >= 0 && r.size > 0 && r.size+int64(len(line)) > r.max {
		if err := r.rotate(); err != nil {
			return err
		}
	}
	n, err := r.f.Write(line)
	r.size += int64(n)
	return err
}

func (r *rotator) name(i int) string { return r.path + "." + strconv.Itoa(i) }

// rotate shifts path.i to path.i+1 (dropping what falls past keep), moves
// the current file to path.1 and opens a new one.
func (r *rotator) rotate() error {
	if err := r.f.Close(); err != nil {
		return fmt.Errorf("rotating the audit log: %w", err)
	}
	r.f = nil
	var errs []error
	if r.keep <= 0 {
		errs = append(errs, os.Remove(r.path))
	} else {
		if err := os.Remove(r.name(r.keep)); err != nil && !errors.Is(err, fs.ErrNotExist) {
			errs = append(errs, err)
		}
		for i := r.keep - 1; i >= 1; i-- {
			if err := os.Rename(r.name(i), r.name(i+1)); err != nil && !errors.Is(err, fs.ErrNotExist) {
				errs = append(errs, err)
			}
		}
		errs = append(errs, os.Rename(r.path, r.name(1)))
	}
	if err := r.open(); err != nil {
		return errors.Join(append(errs, err)...)
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("rotating the audit log: %w", err)
	}
	return nil
}

func (r *rotator) close() error {
	if r.f == nil {
		return nil
	}
	return r.f.Close()
}
