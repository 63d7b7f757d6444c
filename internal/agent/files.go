package agent

import (
	"container/heap"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"slices"
	"strings"
	"syscall"
	"time"

	"kiln/internal/agentproto"
)

const (
	maxListEntries = 1000
	maxWriteBytes  = 32 << 20
	// maxReadBytes caps one read whatever the host asks: a sparse file
	// can claim terabytes, and the response must fit in a frame.
	maxReadBytes = 16 << 20
)

// Every file operation goes through an os.Root opened on the workspace: the
// kernel-checked walk refuses absolute symlinks, ".." and symlinks that
// lead out of the workspace, whatever the box planted there.
//
// Under gVisor that walk is not enough on its own: os.Root opens each
// directory on the way with openat(O_NOFOLLOW|O_DIRECTORY), and gVisor
// follows a final symlink to a directory despite O_NOFOLLOW when
// O_DIRECTORY is set (google/gvisor#14786; Linux fails with ENOTDIR), so
// os.Root never sees "rootlink" -> / and walks out of the workspace. open
// therefore resolves symlinks itself first (resolveLinks) and hands os.Root
// a path without any.

// open resolves p (see splitPath) to a path relative to the workspace root.
func (a *Agent) open(p string) (*os.Root, string, error) {
	parts, err := splitPath(a.cfg.Workspace, p)
	if err != nil {
		return nil, "", err
	}
	root, err := os.OpenRoot(a.cfg.Workspace)
	if err != nil {
		return nil, "", fmt.Errorf("opening workspace: %w", err)
	}
	if parts, err = resolveLinks(root, parts); err != nil {
		root.Close()
		return nil, "", pathErr(p, err)
	}
	if len(parts) == 0 {
		return root, ".", nil
	}
	return root, strings.Join(parts, "/"), nil
}

// maxLinks bounds the symlinks followed while resolving one path (os.Root
// allows 8).
const maxLinks = 8

// resolveLinks follows the symlinks among parts the way os.Root does: a
// relative target is spliced in, ".." pops a directory already known to be
// real, and an absolute target or a ".." above the root is refused. What
// comes back names no symlink, as far as Lstat saw. Resolution stops at the
// first component Lstat cannot see (missing, or under a non-directory): the
// rest goes to os.Root unchanged, which creates it or reports the error.
//
// A symlink planted between this walk and os.Root's is still followed
// under gVisor. Every file operation runs with the file rights of the
// code's user (asCode), so the race gains that code nothing it cannot read
// or write itself; on a Linux kernel os.Root's own walk refuses it.
func resolveLinks(root *os.Root, parts []string) ([]string, error) {
	var done []string // real directories (and, last, any non-symlink)
	links := 0
	for len(parts) > 0 {
		c := parts[0]
		parts = parts[1:]
		switch c {
		case "", ".":
			continue
		case "..":
			if len(done) == 0 {
				return nil, ErrOutsideWorkspace
			}
			done = done[:len(done)-1]
			continue
		}
		p := strings.Join(append(done, c), "/")
		fi, err := root.Lstat(p)
		if err != nil {
			return append(append(done, c), parts...), nil
		}
		if fi.Mode()&fs.ModeSymlink == 0 {
			done = append(done, c)
			continue
		}
		if links++; links > maxLinks {
			return nil, syscall.ELOOP
		}
		target, err := root.Readlink(p)
		if err != nil {
			return nil, err
		}
		if path.IsAbs(target) {
			return nil, ErrOutsideWorkspace
		}
		parts = append(strings.Split(target, "/"), parts...)
	}
	return done, nil
}

func pathErr(p string, err error) error {
	var pe *fs.PathError
	if errors.As(err, &pe) {
		err = pe.Err
	}
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return fmt.Errorf("%s: no such file or directory", p)
	case errors.Is(err, fs.ErrPermission):
		return fmt.Errorf("%s: permission denied", p)
	case errors.Is(err, syscall.ENOSPC), errors.Is(err, syscall.EDQUOT):
		return fmt.Errorf("%s: the workspace is full", p)
	case errors.Is(err, syscall.ENOTDIR):
		return fmt.Errorf("%s: a parent is not a directory", p)
	case strings.Contains(err.Error(), "escapes from parent"), errors.Is(err, syscall.ELOOP), errors.Is(err, ErrOutsideWorkspace):
		return fmt.Errorf("%w: %s (a symlink or .. leads out of it)", ErrOutsideWorkspace, p)
	}
	return fmt.Errorf("%s: %v", p, err)
}

// asCode runs a file operation with the file rights of the code's user,
// when the agent runs as root of its box (the jail, a microVM guest) and
// code runs as someone else: the files it writes belong to that user, and
// the agent reads or writes nothing through a name planted in the
// workspace that the code could not reach itself. Otherwise the agent runs
// as the code's user already.
//
// Where a thread cannot change its file ids (gVisor), the agent acts as
// itself and gives what it creates to the code's user (chown); os.Root
// still confines every walk to the workspace.
func (a *Agent) asCode(f func() error) error {
	if os.Getuid() != 0 || a.cfg.UID <= 0 {
		return f()
	}
	if err := asUser(a.cfg.UID, a.cfg.GID, f); !errors.Is(err, errNoFileIDs) {
		return err
	}
	return f()
}

// chown gives a file the agent made to the code's user, when the agent runs
// as root and code as someone else (and asCode could not act as it).
func (a *Agent) chown(root *os.Root, rel string) {
	if os.Getuid() == 0 && a.cfg.UID > 0 {
		root.Lchown(rel, a.cfg.UID, a.cfg.GID)
	}
}

func (a *Agent) writeFile(p string, data []byte) error {
	return a.asCode(func() error { return a.writeFileAsCode(p, data) })
}

func (a *Agent) readFile(p string, off, max int64) (data []byte, size int64, err error) {
	err = a.asCode(func() error {
		data, size, err = a.readFileAsCode(p, off, max)
		return err
	})
	return data, size, err
}

func (a *Agent) listFiles(p string) (files []agentproto.FileInfo, err error) {
	err = a.asCode(func() error {
		files, err = a.listFilesAsCode(p)
		return err
	})
	return files, err
}

func (a *Agent) writeFileAsCode(p string, data []byte) error {
	if len(data) > maxWriteBytes {
		return fmt.Errorf("file is larger than %d bytes", maxWriteBytes)
	}
	root, rel, err := a.open(p)
	if err != nil {
		return err
	}
	defer root.Close()
	if rel == "." {
		return errors.New("path names the workspace itself, not a file")
	}
	if dir := path.Dir(rel); dir != "." {
		if err := root.MkdirAll(dir, 0o755); err != nil {
			return pathErr(p, err)
		}
		for d := dir; d != "."; d = path.Dir(d) {
			a.chown(root, d)
		}
	}
	if err := writeRegular(root, rel, data); err != nil {
		return pathErr(p, err)
	}
	a.chown(root, rel)
	return nil
}

// writeRegular writes data to rel, refusing anything but a regular file: a
// FIFO planted in the workspace would block the write forever, a device
// node would be written through. O_NONBLOCK keeps the open itself from
// waiting for a FIFO's reader.
func writeRegular(root *os.Root, rel string, data []byte) error {
	f, err := root.OpenFile(rel, os.O_WRONLY|os.O_CREATE|syscall.O_NONBLOCK, 0o644)
	if err != nil {
		return err
	}
	defer f.Close()
	if st, err := f.Stat(); err != nil {
		return err
	} else if !st.Mode().IsRegular() {
		return errors.New("not a regular file")
	}
	if err := f.Truncate(0); err != nil {
		return err
	}
	if _, err := f.Write(data); err != nil {
		return err
	}
	return f.Close()
}

// readFileAsCode reads at most limit bytes of p from offset off (limit 0
// or less: to the end), within maxReadBytes, and returns the file's size.
func (a *Agent) readFileAsCode(p string, off, limit int64) ([]byte, int64, error) {
	if off < 0 {
		return nil, 0, fmt.Errorf("offset %d is negative", off)
	}
	root, rel, err := a.open(p)
	if err != nil {
		return nil, 0, err
	}
	defer root.Close()
	f, err := root.OpenFile(rel, os.O_RDONLY|syscall.O_NONBLOCK, 0)
	if err != nil {
		return nil, 0, pathErr(p, err)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil, 0, pathErr(p, err)
	}
	if st.IsDir() {
		return nil, 0, fmt.Errorf("%s: is a directory; use list_files", p)
	}
	if !st.Mode().IsRegular() {
		return nil, 0, fmt.Errorf("%s: not a regular file", p)
	}
	left := max(st.Size()-off, 0)
	if limit <= 0 || limit > left {
		limit = left
	}
	limit = min(limit, maxReadBytes)
	data, err := io.ReadAll(io.NewSectionReader(f, off, limit))
	if err != nil {
		return nil, 0, pathErr(p, err)
	}
	return data, st.Size(), nil
}

// listFilesAsCode lists the tree under p, up to maxListEntries entries.
func (a *Agent) listFilesAsCode(p string) ([]agentproto.FileInfo, error) {
	root, rel, err := a.open(p)
	if err != nil {
		return nil, err
	}
	defer root.Close()
	if st, err := root.Lstat(rel); err != nil {
		return nil, pathErr(p, err)
	} else if !st.IsDir() {
		return []agentproto.FileInfo{fileInfo(rel, st)}, nil
	}
	out := []agentproto.FileInfo{}
	walkFirst(root, rel, maxListEntries, func(name string, d fs.DirEntry) {
		if info, err := d.Info(); err == nil {
			out = append(out, fileInfo(name, info))
		}
	})
	return out, nil
}

// walkFirst calls fn for the first limit entries of the tree under dir, in
// fs.WalkDir's order (each directory's entries sorted by name, a directory
// before what it holds), without following symlinks. Unlike fs.WalkDir it
// never holds more than limit entries of a directory: a workspace filled
// with a million files would otherwise have the agent read every name
// into memory, in a box whose memory those files have already taken.
// Directories it cannot read are skipped.
func walkFirst(root *os.Root, dir string, limit int, fn func(name string, d fs.DirEntry)) int {
	if limit <= 0 {
		return 0
	}
	f, err := root.Open(dir)
	if err != nil {
		return 0
	}
	first := &nameHeap{}
	for {
		batch, err := f.ReadDir(256)
		for _, e := range batch {
			if first.Len() < limit {
				heap.Push(first, e)
			} else if e.Name() < (*first)[0].Name() {
				(*first)[0] = e
				heap.Fix(first, 0)
			}
		}
		if err != nil {
			break
		}
	}
	f.Close()
	entries := []fs.DirEntry(*first)
	slices.SortFunc(entries, func(a, b fs.DirEntry) int { return strings.Compare(a.Name(), b.Name()) })
	n := 0
	for _, e := range entries {
		if n >= limit {
			break
		}
		name := path.Join(dir, e.Name())
		fn(name, e)
		n++
		if e.IsDir() {
			n += walkFirst(root, name, limit-n, fn)
		}
	}
	return n
}

// nameHeap is a max-heap of directory entries by name: its top is the
// last of the first names kept so far.
type nameHeap []fs.DirEntry

func (h nameHeap) Len() int           { return len(h) }
func (h nameHeap) Less(i, j int) bool { return h[i].Name() > h[j].Name() }
func (h nameHeap) Swap(i, j int)      { h[i], h[j] = h[j], h[i] }
func (h *nameHeap) Push(x any)        { *h = append(*h, x.(fs.DirEntry)) }
func (h *nameHeap) Pop() any {
	old := *h
	x := old[len(old)-1]
	*h = old[:len(old)-1]
	return x
}

// changes lists regular files under the workspace modified at or after since.
func (a *Agent) changes(since time.Time) ([]agentproto.FileInfo, error) {
	all, err := a.listFiles("")
	if err != nil {
		return nil, err
	}
	var out []agentproto.FileInfo
	for _, f := range all {
		if !f.Dir && !f.Symlink && f.ModNano >= since.UnixNano() {
			out = append(out, f)
		}
	}
	return out, nil
}

func fileInfo(p string, info fs.FileInfo) agentproto.FileInfo {
	return agentproto.FileInfo{
		Path:    p,
		Size:    info.Size(),
		Dir:     info.IsDir(),
		Symlink: info.Mode()&fs.ModeSymlink != 0,
		ModNano: info.ModTime().UnixNano(),
		Special: special(info.Mode()),
	}
}

// special names the kind of a file that is neither regular, a directory
// nor a symlink; "" for those.
func special(m fs.FileMode) string {
	switch {
	case m.IsRegular(), m.IsDir(), m&fs.ModeSymlink != 0:
		return ""
	case m&fs.ModeNamedPipe != 0:
		return "fifo"
	case m&fs.ModeSocket != 0:
		return "socket"
	case m&fs.ModeCharDevice != 0:
		return "char-device"
	case m&fs.ModeDevice != 0:
		return "device"
	}
	return "other"
}
