package sandbox

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"time"
	"unicode"

	"kiln/internal/agentproto"
)

// State-level snapshots of an agent-hosted box: the agent packs the box's
// state into one archive inside the box (agentproto.OpSaveState), and
// AgentConn moves its bytes, in chunks, into StateArchive in the snapshot
// directory. Nothing the box sends names a host path or sizes a host
// buffer beyond one chunk: the archive's size is checked against a cap
// and the caller's budget before the first byte is pulled, every chunk
// against what was asked, so the host writes at most the size it allowed.

var _ Snapshotter = (*AgentConn)(nil)

// ErrSnapshotTooLarge is a box whose state is over the snapshot cap.
var ErrSnapshotTooLarge = errors.New("sandbox: the box's state is larger than a snapshot may be")

// StateTimeout bounds saving or loading a box's state in the box: pickling
// gigabytes takes a while, a cell's __reduce__ that never returns takes
// forever (and the box is destroyed).
const StateTimeout = 10 * time.Minute

// stateChunk is how much of an archive one request moves.
const stateChunk = 4 << 20

// maxManifest bounds a manifest as read from a snapshot directory.
const maxManifest = 1 << 20

// MaxStateText bounds the text a snapshot keeps of each of the box's
// lists (the globals it saved, what it dropped): the box names them, and
// the agent's bounds (agentproto.MaxStateNames entries of MaxStateEntry
// bytes) allow a megabyte each, more than a manifest may hold (maxManifest)
// and more than a result should carry.
const MaxStateText = 16 << 10

// BoundStateText returns the box's list cut to MaxStateText bytes, the
// last entry saying how many more there were, each entry valid UTF-8 on
// one line.
func BoundStateText(entries []string) []string {
	var out []string
	left := MaxStateText
	for i, e := range entries {
		e = strings.Map(func(r rune) rune {
			if unicode.IsControl(r) {
				return ' '
			}
			return r
		}, strings.ToValidUTF8(e, "\uFFFD"))
		if len(e) > left {
			return append(out, fmt.Sprintf("… and %d more", len(entries)-i))
		}
		left -= len(e)
		out = append(out, e)
	}
	return out
}

// DefaultSnapshotLimit caps a snapshot's archive when the caller sets no
// cap: the default workspace and memory limits together.
var DefaultSnapshotLimit = DefaultLimits.WorkspaceBytes + DefaultLimits.MemoryBytes

type snapshotLimitKey struct{}

// WithSnapshotLimit returns a context under which Snapshot refuses a box
// whose state archive is over n bytes, before pulling any of it. A
// session sets it from its box's limits (workspace plus memory).
func WithSnapshotLimit(ctx context.Context, n int64) context.Context {
	return context.WithValue(ctx, snapshotLimitKey{}, n)
}

func snapshotLimit(ctx context.Context) int64 {
	if n, ok := ctx.Value(snapshotLimitKey{}).(int64); ok && n > 0 {
		return n
	}
	return DefaultSnapshotLimit
}

type snapshotBudgetKey struct{}

// WithSnapshotBudget returns a context under which Snapshot asks claim
// for the size the box declares for its archive before pulling any of
// it, and refuses the snapshot with claim's error. A session claims the
// bytes against its quotas there: what a box declares is all the host
// will write, as every chunk is checked against it.
func WithSnapshotBudget(ctx context.Context, claim func(size int64) error) context.Context {
	return context.WithValue(ctx, snapshotBudgetKey{}, claim)
}

func snapshotBudget(ctx context.Context, size int64) error {
	if claim, ok := ctx.Value(snapshotBudgetKey{}).(func(int64) error); ok {
		return claim(size)
	}
	return nil
}

// SnapshotLimitFor is the cap on the state of a box with these limits.
func SnapshotLimitFor(l Limits) int64 {
	l = l.WithDefaults()
	return l.WorkspaceBytes + l.MemoryBytes
}

// Snapshot saves the box's state into dir (which must exist and be empty):
// the archive the agent packs, pulled in chunks, and a manifest. The box
// keeps running. A box that breaks the protocol while doing so (a size
// over the cap is not a fault, a chunk other than the one asked is) is
// destroyed, and dir may hold a partial archive: the caller removes dir on
// any error.
func (c *AgentConn) Snapshot(ctx context.Context, dir string) (*SnapshotInfo, error) {
	start := time.Now()
	resp, err := c.call(ctx, agentproto.Request{Op: agentproto.OpSaveState})
	if err != nil {
		return nil, fmt.Errorf("saving box state: %w", err)
	}
	size, limit := resp.Size, snapshotLimit(ctx)
	if size > limit {
		return nil, fmt.Errorf("%w: %d bytes, over the cap of %d (workspace plus memory limit); delete files or variables and try again", ErrSnapshotTooLarge, size, limit)
	}
	if err := snapshotBudget(ctx, size); err != nil {
		return nil, err
	}
	f, err := os.OpenFile(filepath.Join(dir, StateArchive), os.O_WRONLY|os.O_CREATE|os.O_EXCL|syscall.O_NOFOLLOW, 0o600)
	if err != nil {
		return nil, fmt.Errorf("saving box state: %w", err)
	}
	defer f.Close()
	h := sha256.New()
	w := io.MultiWriter(f, h)
	for off := int64(0); off < size; {
		want := min(int64(stateChunk), size-off)
		r, err := c.call(ctx, agentproto.Request{Op: agentproto.OpReadState, Offset: off, MaxBytes: want})
		if err != nil {
			return nil, fmt.Errorf("pulling box state: %w", err)
		}
		if r.Size != size || r.Offset != off || int64(len(r.Data)) != want {
			err := fmt.Errorf("%w: state chunk of %d bytes at %d of %d, asked %d at %d of %d", ErrBroken, len(r.Data), r.Offset, r.Size, want, off, size)
			c.fail(err)
			return nil, err
		}
		if _, err := w.Write(r.Data); err != nil {
			return nil, fmt.Errorf("writing snapshot: %w", err)
		}
		off += want
	}
	if err := f.Sync(); err != nil {
		return nil, fmt.Errorf("writing snapshot: %w", err)
	}
	info := &SnapshotInfo{
		Format:  FormatState,
		Backend: c.backend,
		Created: start.UTC(),
		Took:    time.Since(start),
		SHA256:  hex.EncodeToString(h.Sum(nil)),
		Saved:   BoundStateText(resp.State.Saved),
		Dropped: BoundStateText(resp.State.Dropped),
	}
	if err := WriteManifest(dir, info); err != nil {
		return nil, err
	}
	return info, nil
}

// WriteManifest writes info as dir's manifest, setting info.Bytes to the
// size of every file of the snapshot, the manifest's included.
func WriteManifest(dir string, info *SnapshotInfo) error {
	var total int64
	ents, err := os.ReadDir(dir)
	if err != nil {
		return fmt.Errorf("writing manifest: %w", err)
	}
	for _, e := range ents {
		if e.Name() == ManifestName {
			continue
		}
		if fi, err := e.Info(); err == nil && fi.Mode().IsRegular() {
			total += fi.Size()
		}
	}
	// The manifest's own size depends on the figure it holds: settle it.
	var b []byte
	for n := int64(0); ; {
		info.Bytes = total + n
		if b, err = json.MarshalIndent(info, "", "  "); err != nil {
			return fmt.Errorf("writing manifest: %w", err)
		}
		if int64(len(b)) == n {
			break
		}
		n = int64(len(b))
	}
	if len(b) > maxManifest { // it could not be read back: refused now
		return fmt.Errorf("writing manifest: %d bytes, over the %d a manifest may take", len(b), maxManifest)
	}
	tmp := filepath.Join(dir, "."+ManifestName+".tmp")
	if err := os.WriteFile(tmp, b, 0o600); err != nil {
		return fmt.Errorf("writing manifest: %w", err)
	}
	if err := os.Rename(tmp, filepath.Join(dir, ManifestName)); err != nil {
		return fmt.Errorf("writing manifest: %w", err)
	}
	return nil
}

// ReadManifest reads a snapshot directory's manifest, bounded in size.
func ReadManifest(dir string) (*SnapshotInfo, error) {
	f, err := os.OpenFile(filepath.Join(dir, ManifestName), os.O_RDONLY|syscall.O_NOFOLLOW, 0)
	if err != nil {
		return nil, fmt.Errorf("reading snapshot manifest: %w", err)
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, maxManifest+1))
	if err != nil {
		return nil, fmt.Errorf("reading snapshot manifest: %w", err)
	}
	if len(b) > maxManifest {
		return nil, fmt.Errorf("reading snapshot manifest: over %d bytes", maxManifest)
	}
	var info SnapshotInfo
	if err := json.Unmarshal(b, &info); err != nil {
		return nil, fmt.Errorf("reading snapshot manifest: corrupt: %w", err)
	}
	return &info, nil
}

// StateLoader is implemented by boxes that can load a state-level
// snapshot into themselves (a fresh box, as Restore makes one).
type StateLoader interface {
	// LoadState pushes dir's archive into the box and loads it: its
	// files into the workspace, its globals into the kernel. It returns
	// what could not be loaded.
	LoadState(ctx context.Context, dir string, info *SnapshotInfo) (dropped []string, err error)
}

var _ StateLoader = (*AgentConn)(nil)

// ErrCorruptSnapshot is a snapshot whose archive does not match its
// manifest.
var ErrCorruptSnapshot = errors.New("sandbox: the snapshot is corrupt")

// LoadState pushes the archive in chunks, checking it against the
// manifest's digest before the box loads any of it.
func (c *AgentConn) LoadState(ctx context.Context, dir string, info *SnapshotInfo) ([]string, error) {
	f, err := os.OpenFile(filepath.Join(dir, StateArchive), os.O_RDONLY|syscall.O_NOFOLLOW, 0)
	if err != nil {
		return nil, fmt.Errorf("loading box state: %w", err)
	}
	defer f.Close()
	h := sha256.New()
	buf := make([]byte, stateChunk)
	for off := int64(0); ; {
		n, err := io.ReadFull(f, buf)
		if n > 0 {
			h.Write(buf[:n])
			if _, err := c.call(ctx, agentproto.Request{Op: agentproto.OpWriteState, Offset: off, Data: buf[:n]}); err != nil {
				return nil, fmt.Errorf("pushing box state: %w", err)
			}
			off += int64(n)
		} else if off == 0 {
			// An empty archive: still start one in the box.
			if _, err := c.call(ctx, agentproto.Request{Op: agentproto.OpWriteState}); err != nil {
				return nil, fmt.Errorf("pushing box state: %w", err)
			}
		}
		if err == io.EOF || err == io.ErrUnexpectedEOF {
			break
		}
		if err != nil {
			return nil, fmt.Errorf("loading box state: %w", err)
		}
	}
	if got := hex.EncodeToString(h.Sum(nil)); got != info.SHA256 {
		return nil, fmt.Errorf("%w: its archive's sha256 is %s, the manifest says %q", ErrCorruptSnapshot, got, info.SHA256)
	}
	resp, err := c.call(ctx, agentproto.Request{Op: agentproto.OpLoadState})
	if err != nil {
		return nil, fmt.Errorf("loading box state: %w", err)
	}
	return BoundStateText(resp.State.Dropped), nil
}
