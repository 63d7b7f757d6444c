package mcpserver_test

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"
)

// openStream opens the standalone SSE stream (GET /mcp) of session sid
// and returns its response once the headers are in; the caller reads or
// closes the body.
func (f *httpFixture) openStream(t *testing.T, secret, sid string) *http.Response {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	req, _ := http.NewRequestWithContext(ctx, "GET", "http://"+f.addr+"/mcp", nil)
	req.Header.Set("Accept", "text/event-stream")
	req.Header.Set("Authorization", "Bearer "+secret)
	req.Header.Set("Mcp-Session-Id", sid)
	req.Header.Set("Mcp-Protocol-Version", "2025-06-18")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { resp.Body.Close() })
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("GET stream of session %s: status %d", sid, resp.StatusCode)
	}
	return resp
}

// TestHTTPSessionsWithStreamsMakeRoom: every client of the official SDKs
// keeps a standalone SSE stream (a GET) open in its session, and many
// never end their session. An open stream is not work in flight: when a
// principal's sessions are all at the cap and each holds only its stream,
// a new initialize closes the least recently used one (ending its stream)
// instead of being refused with 429. A session with a request in flight
// is still never closed. (The MCP conformance suite leaks a session with
// a stream per scenario its fixtures fail, and was refused from the
// seventeenth scenario on.)
func TestHTTPSessionsWithStreamsMakeRoom(t *testing.T) {
	lim := testLimits()
	lim.SessionIdle = time.Hour
	lim.MaxSessions = 3
	f := startHTTP(t, lim)

	var sids []string
	var streams []*http.Response
	for range lim.MaxSessions {
		sid := f.initSession(t, f.secret)
		sids = append(sids, sid)
		streams = append(streams, f.openStream(t, f.secret, sid))
	}

	// A request in flight in the least recently used session: a ping
	// whose body has not all arrived. With Expect: 100-continue the
	// server answers 100 once the MCP handler reads the body, so the
	// request is known to be in the handler before the new session.
	ping := `{"jsonrpc":"2.0","id":7,"method":"ping"}`
	c, err := dialFrom("127.0.0.1", f.addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	fmt.Fprintf(c, "POST /mcp HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\nAccept: application/json, text/event-stream\r\nAuthorization: Bearer %s\r\nMcp-Session-Id: %s\r\nMcp-Protocol-Version: 2025-06-18\r\nExpect: 100-continue\r\nContent-Length: %d\r\n\r\n",
		f.addr, f.secret, sids[0], len(ping))
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	br := bufio.NewReader(c)
	if line, err := br.ReadString('\n'); err != nil || !strings.HasPrefix(line, "HTTP/1.1 100 ") {
		t.Fatalf("want 100 Continue, got %q, %v", line, err)
	}
	if line, _ := br.ReadString('\n'); line != "\r\n" {
		t.Fatalf("100 Continue followed by %q", line)
	}
	fmt.Fprint(c, ping[:10])
	// The busy session is now the least recently used one.
	for _, sid := range sids[1:] {
		if st := f.ping(t, f.secret, sid); st != http.StatusOK {
			t.Fatalf("session %s: status %d", sid, st)
		}
	}

	newSID := f.initSession(t, f.secret) // fails the test on a 429

	// The busy session survived: its ping completes.
	fmt.Fprint(c, ping[10:])
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		t.Fatalf("the ping in flight: %v", err)
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Errorf("the session with a request in flight: its ping got status %d, want 200", resp.StatusCode)
	}

	// The least recently used session holding only a stream was closed,
	// and its stream ended.
	done := make(chan error, 1)
	go func() {
		_, err := io.Copy(io.Discard, streams[1].Body)
		done <- err
	}()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Error("the stream of the closed session is still open")
	}
	if st := f.ping(t, f.secret, sids[1]); st != http.StatusNotFound {
		t.Errorf("the evicted session: status %d, want 404", st)
	}
	for _, sid := range []string{sids[0], sids[2], newSID} {
		if st := f.ping(t, f.secret, sid); st != http.StatusOK {
			t.Errorf("session %s: status %d, want 200", sid, st)
		}
	}
	if n := f.liveSessions(); n > lim.MaxSessions {
		t.Errorf("%d transport sessions live, want at most %d", n, lim.MaxSessions)
	}
}
