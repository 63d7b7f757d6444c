package sandbox

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"kiln/internal/agentproto"
)

// stateAgent is a forged agent holding archive as its saved state; lie
// changes its answers.
func stateAgent(t *testing.T, archive []byte, lie func(req agentproto.Request, resp *agentproto.Response)) (*AgentConn, <-chan struct{}, *atomic.Int32) {
	var loads atomic.Int32
	var pushed bytes.Buffer
	c, destroyed := fakeAgent(t, 5*time.Second, func(req agentproto.Request) *agentproto.Response {
		resp := &agentproto.Response{ID: req.ID}
		switch req.Op {
		case agentproto.OpSaveState:
			resp.Size = int64(len(archive))
			resp.State = &agentproto.StateInfo{Saved: []string{"df"}, Dropped: []string{"gen: cannot pickle 'generator' object"}}
		case agentproto.OpReadState:
			end := min(req.Offset+req.MaxBytes, int64(len(archive)))
			resp.Data, resp.Size, resp.Offset = archive[req.Offset:end], int64(len(archive)), req.Offset
		case agentproto.OpWriteState:
			pushed.Write(req.Data)
		case agentproto.OpLoadState:
			loads.Add(1)
			resp.State = &agentproto.StateInfo{Saved: []string{"df"}}
		}
		if lie != nil {
			lie(req, resp)
		}
		return resp
	})
	return c, destroyed, &loads
}

func dirNames(t *testing.T, dir string) []string {
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, e := range ents {
		names = append(names, e.Name())
	}
	return names
}

// An honest snapshot holds exactly the archive's bytes and a manifest,
// and loads back after its digest is checked.
func TestSnapshotForgedAgentHonest(t *testing.T) {
	archive := bytes.Repeat([]byte("kiln"), stateChunk/2) // two chunks
	c, _, loads := stateAgent(t, archive, nil)
	dir := t.TempDir()
	info, err := c.Snapshot(context.Background(), dir)
	if err != nil {
		t.Fatal(err)
	}
	if got := dirNames(t, dir); !slices.Equal(got, []string{ManifestName, StateArchive}) {
		t.Errorf("snapshot dir holds %v", got)
	}
	if b, _ := os.ReadFile(filepath.Join(dir, StateArchive)); !bytes.Equal(b, archive) {
		t.Error("the archive differs from what the box sent")
	}
	read, err := ReadManifest(dir)
	if err != nil {
		t.Fatal(err)
	}
	if read.SHA256 != info.SHA256 || read.Bytes != info.Bytes || read.Bytes < int64(len(archive)) || !slices.Equal(read.Dropped, info.Dropped) {
		t.Errorf("manifest %+v, snapshot said %+v", read, info)
	}
	if _, err := c.LoadState(context.Background(), dir, read); err != nil || loads.Load() != 1 {
		t.Fatalf("loading: %v (%d loads)", err, loads.Load())
	}
	// A corrupt archive is refused before the box loads any of it.
	os.WriteFile(filepath.Join(dir, StateArchive), append(archive[:len(archive)-1], 'x'), 0o600)
	if _, err := c.LoadState(context.Background(), dir, read); !errors.Is(err, ErrCorruptSnapshot) || loads.Load() != 1 {
		t.Fatalf("loading a corrupt archive: %v (%d loads)", err, loads.Load())
	}
}

// A hostile box cannot make the host allocate or write beyond one chunk
// past what it asked, nor write anywhere but the snapshot's archive.
func TestSnapshotForgedAgentHostile(t *testing.T) {
	archive := bytes.Repeat([]byte("x"), 3*stateChunk/2)
	cases := []struct {
		name  string
		lie   func(req agentproto.Request, resp *agentproto.Response)
		limit int64
		want  error
		alive bool // not a fault: the box stays
	}{
		{name: "size over the cap", lie: func(req agentproto.Request, resp *agentproto.Response) {
			if req.Op == agentproto.OpSaveState {
				resp.Size = 1 << 62
			}
		}, want: ErrSnapshotTooLarge, alive: true},
		{name: "size over a session's cap", limit: stateChunk, want: ErrSnapshotTooLarge, alive: true},
		{name: "negative size", lie: func(req agentproto.Request, resp *agentproto.Response) {
			if req.Op == agentproto.OpSaveState {
				resp.Size = -1
			}
		}, want: ErrBroken},
		{name: "chunk longer than asked", lie: func(req agentproto.Request, resp *agentproto.Response) {
			if req.Op == agentproto.OpReadState {
				resp.Data = make([]byte, req.MaxBytes+1)
				resp.Size = 1 << 40
			}
		}, want: ErrBroken},
		{name: "short chunk", lie: func(req agentproto.Request, resp *agentproto.Response) {
			if req.Op == agentproto.OpReadState {
				resp.Data = resp.Data[:1]
			}
		}, want: ErrBroken},
		{name: "chunk at another offset", lie: func(req agentproto.Request, resp *agentproto.Response) {
			if req.Op == agentproto.OpReadState && req.Offset > 0 {
				resp.Offset = 0
			}
		}, want: ErrBroken},
		{name: "size changes between chunks", lie: func(req agentproto.Request, resp *agentproto.Response) {
			if req.Op == agentproto.OpReadState && req.Offset > 0 {
				resp.Size++
			}
		}, want: ErrBroken},
		{name: "too many dropped entries", lie: func(req agentproto.Request, resp *agentproto.Response) {
			if req.Op == agentproto.OpSaveState {
				resp.State.Dropped = make([]string, agentproto.MaxStateNames+1)
			}
		}, want: ErrBroken},
		{name: "dropped entry too long", lie: func(req agentproto.Request, resp *agentproto.Response) {
			if req.Op == agentproto.OpSaveState {
				resp.State.Dropped = []string{strings.Repeat("a", agentproto.MaxStateEntry+1)}
			}
		}, want: ErrBroken},
		{name: "no state report", lie: func(req agentproto.Request, resp *agentproto.Response) {
			resp.State = nil
		}, want: ErrBroken},
		{name: "state report on a read", lie: func(req agentproto.Request, resp *agentproto.Response) {
			if req.Op == agentproto.OpReadState {
				resp.State = &agentproto.StateInfo{}
			}
		}, want: ErrBroken},
		{name: "a path in the state report", lie: func(req agentproto.Request, resp *agentproto.Response) {
			if req.Op == agentproto.OpSaveState {
				resp.State.Saved = []string{"../../etc/passwd"}
			}
		}, alive: true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			c, destroyed, _ := stateAgent(t, archive, tc.lie)
			parent := t.TempDir()
			dir := filepath.Join(parent, "snap")
			os.Mkdir(dir, 0o700)
			ctx := context.Background()
			if tc.limit > 0 {
				ctx = WithSnapshotLimit(ctx, tc.limit)
			}
			_, err := c.Snapshot(ctx, dir)
			if tc.want == nil {
				if err != nil {
					t.Fatal(err)
				}
			} else if !errors.Is(err, tc.want) {
				t.Fatalf("got %v, want %v", err, tc.want)
			}
			t.Logf("%v", err)
			if got := dirNames(t, parent); !slices.Equal(got, []string{"snap"}) {
				t.Errorf("the host wrote %v next to the snapshot", got)
			}
			for _, n := range dirNames(t, dir) {
				if n != StateArchive && n != ManifestName {
					t.Errorf("the host wrote %s in the snapshot", n)
				}
			}
			if st, err := os.Stat(filepath.Join(dir, StateArchive)); err == nil && st.Size() > int64(len(archive)) {
				t.Errorf("the host wrote %d bytes of a %d-byte archive", st.Size(), len(archive))
			}
			select {
			case <-destroyed:
				if tc.alive {
					t.Error("the box was destroyed")
				}
			case <-time.After(200 * time.Millisecond):
				if !tc.alive {
					t.Error("the box was not destroyed")
				}
			}
		})
	}
}

// A manifest of an unknown format or version is refused by name.
func TestRestoreRefusesUnknownFormats(t *testing.T) {
	for _, format := range []string{"kiln-state/2", "criu/1", ""} {
		dir := t.TempDir()
		if err := WriteManifest(dir, &SnapshotInfo{Format: format, Backend: "jail"}); err != nil {
			t.Fatal(err)
		}
		_, err := Restore(context.Background(), noBackend{}, Spec{}, dir)
		if !errors.Is(err, ErrSnapshotFormat) {
			t.Errorf("%q: got %v", format, err)
		}
		t.Logf("%q: %v", format, err)
	}
	dir := t.TempDir()
	os.WriteFile(filepath.Join(dir, ManifestName), []byte("{not json"), 0o600)
	if _, err := Restore(context.Background(), noBackend{}, Spec{}, dir); err == nil || !strings.Contains(err.Error(), "corrupt") {
		t.Errorf("a corrupt manifest: %v", err)
	}
}

type noBackend struct{}

func (noBackend) Name() string { return "none" }
func (noBackend) Create(context.Context, Spec) (Sandbox, error) {
	return nil, errors.New("no boxes here")
}
func (noBackend) Close() error { return nil }

// What a box names in its state answer is kept within MaxStateText, on
// one line per entry, and a manifest too large to read back is refused
// when it is written.
func TestBoundStateText(t *testing.T) {
	many := make([]string, agentproto.MaxStateNames)
	for i := range many {
		many[i] = strings.Repeat("x", agentproto.MaxStateEntry)
	}
	got := BoundStateText(many)
	var n int
	for _, e := range got {
		n += len(e)
	}
	if n > MaxStateText+64 || !strings.HasPrefix(got[len(got)-1], "… and ") {
		t.Errorf("bounded to %d entries, %d bytes, last %q", len(got), n, got[len(got)-1])
	}
	if got := BoundStateText([]string{"a\nb\x1b[2J", "ok", "\xff"}); !slices.Equal(got, []string{"a b [2J", "ok", "\uFFFD"}) {
		t.Errorf("control characters and bad UTF-8: %q", got)
	}
	dir := t.TempDir()
	if err := WriteManifest(dir, &SnapshotInfo{Format: FormatState, Saved: many}); err == nil {
		t.Error("wrote a manifest over the read cap")
	}
}
