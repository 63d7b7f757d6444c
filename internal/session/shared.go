package session

import (
	"archive/tar"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"path"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"
)

// Shared saves: with HibernateOptions.Shared, each session's newest
// hibernation save (at idle, at a checkpoint, at shutdown) is also put in
// storage that other servers reach, an S3-compatible bucket
// (internal/sharedsaves), and a server that resumes a session whose save
// there is newer than its own, or that has none, takes that one. So a
// session outlives the server that saved it and the node its box ran on
// together: the next server its client reaches resumes it from the last
// save any server made. The local store stays the working copy; the
// shared one holds one object per session, replaced by each save.
//
// An object is a tar of the save's directory, named by a digest of the
// principal and session (sharedKey), so the bucket's names say neither;
// when it was taken travels beside it (SharedSave.Saved). What comes back
// is untrusted: it is unpacked as regular files and directories only,
// under the save's temporary directory, within the size the quotas claim
// for it, and the box's restore checks its bytes as for any save.

// SharedSaves is storage for sessions' newest saves that many servers
// share. Its methods must be safe for concurrent use.
type SharedSaves interface {
	// Put stores body as key's save, taken at saved, replacing any
	// other; size is body's length, or -1 when it is not known. A Put
	// whose body fails must leave the save there before it.
	Put(ctx context.Context, key string, saved time.Time, size int64, body io.Reader) error
	// Stat says when key's save was taken and its size; fs.ErrNotExist
	// when there is none.
	Stat(ctx context.Context, key string) (SharedSave, error)
	// Get opens key's save; fs.ErrNotExist when there is none.
	Get(ctx context.Context, key string) (io.ReadCloser, SharedSave, error)
	// Delete removes key's save; none there is no error.
	Delete(ctx context.Context, key string) error
	// Expire removes the saves taken before cutoff, except those keep
	// says to keep, and returns how many it removed.
	Expire(ctx context.Context, cutoff time.Time, keep func(key string) bool) (int, error)
	// String names the storage, for logs (never a secret).
	String() string
}

// SharedSave is what SharedSaves knows of one save.
type SharedSave struct {
	Saved time.Time
	Size  int64
}

// sharedKey names a session's save in shared storage.
func sharedKey(principal, session string) string {
	h := sha256.Sum256([]byte("kiln-save\x00" + principal + "\x00" + session))
	return hex.EncodeToString(h[:])
}

// sharedTimeout bounds one operation on shared storage that a call waits
// for (a Stat or a Delete); a Get or a Put is bounded by the save's own.
const sharedTimeout = 10 * time.Second

// sharedExpireEvery is how often a server sweeps shared storage for saves
// past the TTL (every server does; a sweep is one listing).
const sharedExpireEvery = time.Hour

// sharedPutTimeout bounds one upload, which runs in the background
// (shutdown waits for those in flight for HibernateOptions.SaveTimeout).
const sharedPutTimeout = 10 * time.Minute

// sharer is hibernation's side of shared saves.
type sharer struct {
	saves SharedSaves
	st    *store
	log   *slog.Logger
	// pushes are uploads in flight: Close waits for them.
	pushes sync.WaitGroup
	mu     sync.Mutex
	// pushed is, per key, the newest save put (or being put); an older
	// save that comes late is not put over it. lock serializes one key's
	// uploads.
	pushed map[string]time.Time
	locks  map[string]*sync.Mutex
	swept  time.Time
}

func newSharer(saves SharedSaves, st *store) *sharer {
	return &sharer{saves: saves, st: st, log: st.log, pushed: map[string]time.Time{}, locks: map[string]*sync.Mutex{}}
}

// push puts the save in dir (a snap-<ns> directory) as the session's, in
// the background. A failure is logged: the local save stands, and the
// next save tries again.
func (sh *sharer) push(principal, session, dir string) {
	saved, ok := snapTime(filepath.Base(dir))
	if !ok {
		return
	}
	key := sharedKey(principal, session)
	sh.mu.Lock()
	if !saved.After(sh.pushed[key]) {
		sh.mu.Unlock()
		return
	}
	sh.pushed[key] = saved
	lock := sh.locks[key]
	if lock == nil {
		lock = new(sync.Mutex)
		sh.locks[key] = lock
	}
	sh.pushes.Add(1)
	sh.mu.Unlock()
	go func() {
		defer sh.pushes.Done()
		lock.Lock()
		defer lock.Unlock()
		sh.mu.Lock()
		newer := sh.pushed[key].After(saved)
		sh.mu.Unlock()
		if newer { // a later save is queued behind this one
			return
		}
		ctx, cancel := context.WithTimeout(context.Background(), sharedPutTimeout)
		defer cancel()
		start := time.Now()
		size, err := packedSize(dir)
		if err == nil {
			pr, pw := io.Pipe()
			go func() { pw.CloseWithError(pack(dir, pw)) }()
			err = sh.saves.Put(ctx, key, saved, size, pr)
			pr.CloseWithError(errors.New("upload ended"))
		}
		if err != nil {
			sh.log.Warn("could not put a session's save in shared storage; the next save tries again", "session", session, "principal", principal, "storage", sh.saves.String(), "err", err)
			sh.mu.Lock()
			if sh.pushed[key].Equal(saved) {
				delete(sh.pushed, key)
			}
			sh.mu.Unlock()
			return
		}
		sh.log.Debug("session's save put in shared storage", "session", session, "principal", principal, "bytes", size, "took", time.Since(start))
	}()
}

// pull brings the session's save from shared storage into the local
// store when it is newer than the local one (or there is none there), and
// says whether it did. It is a no-op when shared storage has none; a
// failure is logged and the local save, if any, is used.
func (sh *sharer) pull(ctx context.Context, principal, session string) bool {
	key := sharedKey(principal, session)
	sctx, cancel := context.WithTimeout(ctx, sharedTimeout)
	remote, err := sh.saves.Stat(sctx, key)
	cancel()
	if errors.Is(err, fs.ErrNotExist) {
		return false
	}
	if err != nil {
		sh.log.Warn("could not reach shared storage for a session's save; using this server's own, if any", "session", session, "principal", principal, "storage", sh.saves.String(), "err", err)
		return false
	}
	if local, err := sh.st.latest(principal, session); err == nil && !remote.Saved.After(local.saved) {
		return false
	}
	start := time.Now()
	dir, err := sh.st.fetch(ctx, principal, session, func(tmp string, claim func(int64) error) (time.Time, error) {
		body, got, err := sh.saves.Get(ctx, key)
		if err != nil {
			return time.Time{}, err
		}
		defer body.Close()
		if got.Size < 0 { // the server's word, like the rest
			return time.Time{}, fmt.Errorf("shared storage gave the save a size of %d", got.Size)
		}
		if err := claim(got.Size); err != nil {
			return time.Time{}, err
		}
		if err := unpack(body, tmp, got.Size); err != nil {
			return time.Time{}, err
		}
		return got.Saved, nil
	})
	if err != nil {
		sh.log.Warn("could not take a session's save from shared storage; using this server's own, if any", "session", session, "principal", principal, "storage", sh.saves.String(), "err", err)
		return false
	}
	sh.mu.Lock()
	if t, _ := snapTime(filepath.Base(dir)); t.After(sh.pushed[key]) {
		sh.pushed[key] = t // it is there already
	}
	sh.mu.Unlock()
	sh.log.Info("took a session's save from shared storage", "session", session, "principal", principal, "saved", remote.Saved, "took", time.Since(start))
	return true
}

// has says whether shared storage holds a save of the session.
func (sh *sharer) has(ctx context.Context, principal, session string) bool {
	ctx, cancel := context.WithTimeout(ctx, sharedTimeout)
	defer cancel()
	_, err := sh.saves.Stat(ctx, sharedKey(principal, session))
	return err == nil
}

// drop deletes the session's save from shared storage: it was reset, or
// found stale or broken.
func (sh *sharer) drop(principal, session string) {
	key := sharedKey(principal, session)
	sh.mu.Lock()
	delete(sh.pushed, key)
	sh.mu.Unlock()
	ctx, cancel := context.WithTimeout(context.Background(), sharedTimeout)
	defer cancel()
	if err := sh.saves.Delete(ctx, key); err != nil {
		sh.log.Warn("could not delete a session's save from shared storage", "session", session, "principal", principal, "storage", sh.saves.String(), "err", err)
	}
}

// expire removes shared saves past ttl, at most once per
// sharedExpireEvery, keeping those of the sessions live here.
func (sh *sharer) expire(ttl time.Duration, live func() map[string]bool) {
	now := time.Now()
	sh.mu.Lock()
	if now.Sub(sh.swept) < min(sharedExpireEvery, ttl/4) {
		sh.mu.Unlock()
		return
	}
	sh.swept = now
	sh.mu.Unlock()
	keep := live()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	n, err := sh.saves.Expire(ctx, now.Add(-ttl), func(key string) bool { return keep[key] })
	if err != nil {
		sh.log.Warn("could not expire old saves in shared storage", "storage", sh.saves.String(), "err", err)
	}
	if n > 0 {
		sh.log.Info("expired saves in shared storage", "storage", sh.saves.String(), "removed", n, "ttl", ttl)
	}
}

// wait waits for the uploads in flight, until ctx ends.
func (sh *sharer) wait(ctx context.Context) {
	done := make(chan struct{})
	go func() {
		sh.pushes.Wait()
		close(done)
	}()
	select {
	case <-done:
	case <-ctx.Done():
		sh.log.Warn("stopped before every session's save reached shared storage", "storage", sh.saves.String())
	}
}

// Limits on what a shared save may unpack to: a save is a manifest and a
// few archives (a backend's own format, a few directories of them).
const (
	maxSharedEntries = 4096
	maxSharedDepth   = 8
	// sharedSlack is what a shared save's tar may hold beyond the cap on
	// one save's files: its headers and padding.
	sharedSlack = (maxSharedEntries + 2) * 1024
)

// packedSize is the length of pack(dir)'s tar.
func packedSize(dir string) (int64, error) {
	var n int64 = 1024 // the two zero blocks at the end
	err := walkSave(dir, func(rel string, fi fs.FileInfo) error {
		n += 512
		if fi.Mode().IsRegular() {
			n += (fi.Size() + 511) &^ 511
		}
		return nil
	})
	return n, err
}

// pack writes dir's directories and regular files as a tar, names
// relative and short (USTAR, one 512-byte header each), nothing else.
func pack(dir string, w io.Writer) error {
	tw := tar.NewWriter(w)
	err := walkSave(dir, func(rel string, fi fs.FileInfo) error {
		h := &tar.Header{Name: rel, Mode: 0o600, ModTime: time.Unix(fi.ModTime().Unix(), 0), Format: tar.FormatUSTAR}
		if fi.IsDir() {
			h.Typeflag, h.Name, h.Mode = tar.TypeDir, rel+"/", 0o700
			return tw.WriteHeader(h)
		}
		f, err := os.OpenFile(filepath.Join(dir, rel), os.O_RDONLY|syscall.O_NOFOLLOW, 0)
		if err != nil {
			return err
		}
		defer f.Close()
		h.Typeflag, h.Size = tar.TypeReg, fi.Size()
		if err := tw.WriteHeader(h); err != nil {
			return err
		}
		if _, err := io.CopyN(tw, f, fi.Size()); err != nil {
			return fmt.Errorf("%s changed while it was put: %w", rel, err)
		}
		return nil
	})
	if err != nil {
		return err
	}
	return tw.Close()
}

// walkSave calls f for each directory and regular file under dir, in
// lexical order, with its slash-separated relative name; anything else
// (a save holds nothing else) is an error.
func walkSave(dir string, f func(rel string, fi fs.FileInfo) error) error {
	return filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if p == dir {
			return nil
		}
		rel, err := filepath.Rel(dir, p)
		if err != nil {
			return err
		}
		fi, err := d.Info()
		if err != nil {
			return err
		}
		if !fi.IsDir() && !fi.Mode().IsRegular() {
			return fmt.Errorf("a save holds %s, which is neither a file nor a directory", rel)
		}
		if len(rel) > 100 { // USTAR's name field
			return fmt.Errorf("a save holds a name too long to share: %s", rel)
		}
		return f(filepath.ToSlash(rel), fi)
	})
}

// unpack writes the tar r into dir, which exists and is empty: only
// directories and regular files, at relative names that stay under dir,
// at most limit bytes of files in all, each name once. What it refuses
// leaves dir for the caller to remove.
func unpack(r io.Reader, dir string, limit int64) error {
	tr := tar.NewReader(r)
	var total int64
	seen := map[string]bool{}
	for n := 0; ; n++ {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return fmt.Errorf("the shared save is not a readable archive: %w", err)
		}
		if n >= maxSharedEntries {
			return fmt.Errorf("the shared save holds more than %d entries", maxSharedEntries)
		}
		name := strings.TrimSuffix(h.Name, "/")
		clean := path.Clean(name)
		if name == "" || clean != name || path.IsAbs(name) || clean == "." || clean == ".." || strings.HasPrefix(clean, "../") ||
			strings.ContainsRune(name, 0) || strings.Contains(name, "\\") || strings.Count(clean, "/") >= maxSharedDepth {
			return fmt.Errorf("the shared save holds a name outside its directory: %q", h.Name)
		}
		if seen[clean] {
			return fmt.Errorf("the shared save holds %q twice", clean)
		}
		seen[clean] = true
		dst := filepath.Join(dir, filepath.FromSlash(clean))
		switch h.Typeflag {
		case tar.TypeDir:
			// Mkdir, not MkdirAll: a parent must come first, as pack
			// writes them, so no name can pass through a file.
			if err := os.Mkdir(dst, 0o700); err != nil {
				return fmt.Errorf("unpacking the shared save: %w", err)
			}
		case tar.TypeReg:
			if h.Size < 0 || h.Size > limit-total {
				return fmt.Errorf("the shared save is larger than it said (%d bytes)", limit)
			}
			total += h.Size
			f, err := os.OpenFile(dst, os.O_WRONLY|os.O_CREATE|os.O_EXCL|syscall.O_NOFOLLOW, 0o600)
			if err != nil {
				return fmt.Errorf("unpacking the shared save: %w", err)
			}
			_, err = io.CopyN(f, tr, h.Size)
			if cerr := f.Close(); err == nil {
				err = cerr
			}
			if err != nil {
				return fmt.Errorf("unpacking the shared save: %w", err)
			}
		default:
			return fmt.Errorf("the shared save holds %q, which is neither a file nor a directory", h.Name)
		}
	}
}
