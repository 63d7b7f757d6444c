package microvm

import (
	"errors"
	"fmt"
	"io"
	"os"

	"golang.org/x/sys/unix"
)

// A template's guest RAM lives in a memfd. Its clones map it privately
// (share=off) and QEMU opens it read-write even then (this QEMU's
// readonly=on would map the guest's RAM read-only), so a file would have
// to be writable by every clone's uid. A memfd sealed against writing,
// growing and shrinking opens read-write for anyone who holds it and maps
// privately copy-on-write, but no clone can change it: a compromised QEMU
// cannot reach the next clone through the template.

// newMemfd returns an empty, sealable memfd of size bytes.
func newMemfd(name string, size int64) (*os.File, error) {
	fd, err := unix.MemfdCreate(name, unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		return nil, fmt.Errorf("creating memfd: %w", err)
	}
	f := os.NewFile(uintptr(fd), name)
	if err := f.Truncate(size); err != nil {
		f.Close()
		return nil, fmt.Errorf("sizing memfd: %w", err)
	}
	return f, nil
}

// memfdSeals forbid every change to a template's RAM.
const memfdSeals = unix.F_SEAL_WRITE | unix.F_SEAL_GROW | unix.F_SEAL_SHRINK | unix.F_SEAL_SEAL

// sealMemfd makes f unchangeable. It fails while a shared writable mapping
// of it exists (a template QEMU still running).
func sealMemfd(f *os.File) error {
	if _, err := unix.FcntlInt(f.Fd(), unix.F_ADD_SEALS, memfdSeals); err != nil {
		return fmt.Errorf("sealing memfd: %w", err)
	}
	return nil
}

// copySparse copies src's data to dst at the same offsets, skipping holes
// (the guest RAM a template never touched), and gives dst src's size.
func copySparse(dst, src *os.File) error {
	fi, err := src.Stat()
	if err != nil {
		return err
	}
	size := fi.Size()
	if dfi, err := dst.Stat(); err != nil {
		return err
	} else if dfi.Size() != size {
		if err := dst.Truncate(size); err != nil {
			return err
		}
	}
	fd := int(src.Fd())
	for off := int64(0); off < size; {
		data, err := unix.Seek(fd, off, unix.SEEK_DATA)
		if errors.Is(err, unix.ENXIO) {
			return nil // only a hole remains
		}
		if err != nil {
			return fmt.Errorf("seeking data: %w", err)
		}
		hole, err := unix.Seek(fd, data, unix.SEEK_HOLE)
		if err != nil {
			return fmt.Errorf("seeking hole: %w", err)
		}
		if _, err := io.Copy(io.NewOffsetWriter(dst, data), io.NewSectionReader(src, data, hole-data)); err != nil {
			return fmt.Errorf("copying guest ram: %w", err)
		}
		off = hole
	}
	return nil
}

// loadMemfd reads a saved template's RAM file into a sealed memfd.
func loadMemfd(path string) (*os.File, error) {
	src, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer src.Close()
	fi, err := src.Stat()
	if err != nil {
		return nil, err
	}
	m, err := newMemfd("kiln-template", fi.Size())
	if err != nil {
		return nil, err
	}
	if err := errors.Join(copySparse(m, src), sealMemfd(m)); err != nil {
		m.Close()
		return nil, fmt.Errorf("loading %s: %w", path, err)
	}
	return m, nil
}
