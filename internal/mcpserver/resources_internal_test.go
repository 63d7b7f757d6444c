package mcpserver

import (
	"bytes"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/modelcontextprotocol/go-sdk/mcp"

	"kiln/internal/agentproto"
	"kiln/internal/session"
)

func names(items []*resItem) []string {
	var out []string
	for _, it := range items {
		out = append(out, it.name)
	}
	return out
}

// TestResStoreBounds: the store holds at most MaxBytesPerPrincipal for
// one principal and MaxBytes in all, dropping the oldest first, refuses
// what can never fit, and forgets everything after the TTL.
func TestResStoreBounds(t *testing.T) {
	mgr := session.NewManager(session.Options{Mode: session.ModePerCall})
	defer mgr.Close()
	st := newResStore(mgr, ResourceOptions{MaxBytes: 250, MaxBytesPerPrincipal: 130, TTL: time.Minute})
	now := time.Unix(1000, 0)
	st.now = func() time.Time { return now }
	put := func(principal, name string, n int) bool {
		return st.put(&resItem{uri: "kiln://per-call/calls/1/" + principal + "/" + name, principal: principal, session: perCallHost,
			name: name, data: bytes.Repeat([]byte("x"), n), size: int64(n), held: true})
	}
	for _, p := range []struct {
		who, name string
		n         int
	}{{"a", "a1", 60}, {"a", "a2", 60}, {"a", "a3", 60}, {"b", "b1", 60}, {"c", "c1", 60}, {"c", "c2", 60}} {
		if !put(p.who, p.name, p.n) {
			t.Fatalf("%s refused", p.name)
		}
	}
	// a1 went for a's own bound (180 > 130); a2 for the total (300 > 250).
	for who, want := range map[string][]string{"a": {"a3"}, "b": {"b1"}, "c": {"c2", "c1"}} {
		if diff := cmp.Diff(want, names(st.list(who))); diff != "" {
			t.Errorf("%s holds (-want +got):\n%s", who, diff)
		}
	}
	if a, total := st.heldBytes("a"); a != 60 || total != 240 {
		t.Errorf("held %d for a, %d in all; want 60 and 240", a, total)
	}
	if put("a", "huge", 131) {
		t.Error("an output over the per-principal bound was held")
	}
	if st.get("b", "kiln://per-call/calls/1/a/a3") != nil {
		t.Error("b got a's item")
	}
	now = now.Add(2 * time.Minute)
	if got := st.list("c"); len(got) != 0 {
		t.Errorf("after the TTL c still holds %v", names(got))
	}
	if _, total := st.heldBytes(""); total != 0 {
		t.Errorf("after the TTL %d bytes are held", total)
	}
}

// TestCutStream: the head and tail a result shows stay within the cap, on
// rune boundaries, and within what the box kept on each side of its cut.
func TestCutStream(t *testing.T) {
	for _, c := range []struct {
		name string
		in   agentproto.Stream
		n    int
		want agentproto.Stream
	}{
		{"short", agentproto.Stream{Text: "abc", Total: 3}, 10, agentproto.Stream{Text: "abc", Total: 3}},
		{"plain", agentproto.Stream{Text: "0123456789", Total: 10}, 4, agentproto.Stream{Text: "0189", Total: 10, Cut: 2}},
		{"runes", agentproto.Stream{Text: "ééééé", Total: 10}, 5, agentproto.Stream{Text: "éé", Total: 10, Cut: 2}},
		{"kept cut", agentproto.Stream{Text: "ab0123456789", Total: 100, Cut: 1}, 6, agentproto.Stream{Text: "a789", Total: 100, Cut: 1}},
	} {
		t.Run(c.name, func(t *testing.T) {
			if diff := cmp.Diff(c.want, cutStream(c.in, c.n)); diff != "" {
				t.Errorf("(-want +got):\n%s", diff)
			}
		})
	}
}

// TestRenderWithoutLinksCuts: a result rendered with nothing to file
// (render, as a caller without a request uses it) still shows no more
// output than InlineOutput, and names no URI.
func TestRenderWithoutLinksCuts(t *testing.T) {
	mgr := session.NewManager(session.Options{Mode: session.ModePerCall, MaxOutput: 1 << 20})
	defer mgr.Close()
	s := New(Options{Manager: mgr, Resources: ResourceOptions{InlineOutput: 10}})
	long := strings.Repeat("x", 100)
	res := s.render(&session.Outcome{ExecResult: &agentproto.ExecResult{Stdout: agentproto.Stream{Text: long, Total: 100}}}, nil)
	tx := res.Content[0].(*mcp.TextContent).Text
	if strings.Contains(tx, long) || !strings.Contains(tx, "[… truncated 90 of 100 bytes …]") || strings.Contains(tx, "kiln://") {
		t.Errorf("%q", tx)
	}
	if got := res.StructuredContent.(map[string]any)["stdout"].(string); len(got) != 10 {
		t.Errorf("structuredContent stdout of %d bytes", len(got))
	}
}

// TestResStoreItemsPerPrincipal: one principal linking many files drops
// its own oldest links, not what another holds.
func TestResStoreItemsPerPrincipal(t *testing.T) {
	mgr := session.NewManager(session.Options{Mode: session.ModePerCall})
	defer mgr.Close()
	st := newResStore(mgr, ResourceOptions{})
	st.put(&resItem{uri: "kiln://per-call/calls/1/stdout", principal: "b", name: "stdout", data: []byte("b's"), held: true})
	for i := range maxItemsPerPrincipal + 100 {
		st.put(&resItem{uri: fmt.Sprintf("kiln://per-call/calls/2/files/%d", i), principal: "a", name: fmt.Sprint(i)})
	}
	if got := len(st.list("a")); got != maxItemsPerPrincipal {
		t.Errorf("a holds %d items, want %d", got, maxItemsPerPrincipal)
	}
	if st.get("b", "kiln://per-call/calls/1/stdout") == nil {
		t.Error("a's links pushed out b's output")
	}
	if got := st.list("a")[0].name; got != fmt.Sprint(maxItemsPerPrincipal+99) {
		t.Errorf("a's newest item is %s", got)
	}
}

// TestResStoreKeyedByPrincipal: two principals filing the same kiln:// URI
// (session names are each principal's own, so file URIs coincide) hold
// an entry each. Before the store was keyed by principal and URI, the
// second put dropped the first principal's entry from their list.
func TestResStoreKeyedByPrincipal(t *testing.T) {
	mgr := session.NewManager(session.Options{Mode: session.ModePerCall})
	defer mgr.Close()
	st := newResStore(mgr, ResourceOptions{})
	const uri = "kiln://work/files/report.csv"
	for _, who := range []string{"alice", "mallory"} {
		st.put(&resItem{uri: uri, principal: who, session: "work", name: who + "-report.csv", size: 3})
	}
	for _, who := range []string{"alice", "mallory"} {
		if diff := cmp.Diff([]string{who + "-report.csv"}, names(st.list(who))); diff != "" {
			t.Errorf("%s lists (-want +got):\n%s", who, diff)
		}
		if it := st.get(who, uri); it == nil || it.principal != who {
			t.Errorf("%s reads %+v at %s, want their own entry", who, it, uri)
		}
	}
	// Filing it again replaces only that principal's entry.
	st.put(&resItem{uri: uri, principal: "mallory", session: "work", name: "again.csv", size: 3})
	if got := names(st.list("alice")); len(got) != 1 || got[0] != "alice-report.csv" {
		t.Errorf("after mallory filed %s again alice lists %v", uri, got)
	}
	if got := names(st.list("mallory")); len(got) != 1 || got[0] != "again.csv" {
		t.Errorf("mallory lists %v after filing %s again, want [again.csv]", got, uri)
	}
	if n := st.count["mallory"]; n != 1 {
		t.Errorf("mallory is counted %d items, want 1", n)
	}
}
