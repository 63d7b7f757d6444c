package mcpserver_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/modelcontextprotocol/go-sdk/mcp"

	"kiln/internal/mcpserver"
	"kiln/internal/sandbox"
	"kiln/internal/session"
)

// dialBig is dial with a client that accepts frames of any size, as the
// TypeScript SDK's does: the Go SDK's own clients stop at 16 MiB a frame,
// and a 20 MiB file is 27 MiB of base64.
func dialBig(t testing.TB, srv *mcpserver.Server) *mcp.ClientSession {
	t.Helper()
	c1, c2 := net.Pipe()
	ss, err := srv.MCP().Connect(context.Background(), &mcp.IOTransport{Reader: c2, Writer: c2}, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ss.Close() })
	cs, err := mcp.NewClient(&mcp.Implementation{Name: "test", Version: "1"}, nil).Connect(context.Background(), &mcp.IOTransport{Reader: c1, Writer: c1, MaxLineLength: -1}, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cs.Close() })
	return cs
}

// serveRes builds kiln's MCP server on b with resource options.
func serveRes(t *testing.T, b sandbox.Backend, mode session.Mode, maxOutput int, ro mcpserver.ResourceOptions) *mcpserver.Server {
	t.Helper()
	mgr := session.NewManager(session.Options{Backend: b, Mode: mode, Preload: []string{"matplotlib"},
		DefaultTimeout: 60 * time.Second, MaxOutput: maxOutput, Grace: time.Second})
	t.Cleanup(mgr.Close)
	return mcpserver.New(mcpserver.Options{Manager: mgr, Backend: b.Name(), Resources: ro})
}

func links(res *mcp.CallToolResult) []*mcp.ResourceLink {
	var out []*mcp.ResourceLink
	for _, c := range res.Content {
		if l, ok := c.(*mcp.ResourceLink); ok {
			out = append(out, l)
		}
	}
	return out
}

func readRes(t *testing.T, cs *mcp.ClientSession, uri string) (*mcp.ResourceContents, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	res, err := cs.ReadResource(ctx, &mcp.ReadResourceParams{URI: uri})
	if err != nil {
		return nil, err
	}
	if len(res.Contents) != 1 {
		t.Fatalf("%s: %d contents", uri, len(res.Contents))
	}
	return res.Contents[0], nil
}

func body(c *mcp.ResourceContents) []byte {
	if c.Blob != nil {
		return c.Blob
	}
	return []byte(c.Text)
}

// chartCode draws a small line chart (a few KiB of PNG) and a large
// noise image (about 1.5 MB of PNG: noise does not compress).
const chartCode = `
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt, numpy as np
plt.plot([1, 2, 3], [3, 1, 2]); plt.show()
fig = plt.figure(figsize=(8, 8), dpi=100)
plt.imshow(np.random.default_rng(1).random((800, 800, 3))); plt.axis("off"); plt.show()
`

// TestChartInlineBigImageLinked: a chart under the inline threshold is an
// image block; an image over it is a resource_link whose resources/read
// is the same PNG, and the text names its URI for clients that do not
// follow links.
func TestChartInlineBigImageLinked(t *testing.T) {
	onBackends(t, func(t *testing.T, b sandbox.Backend) {
		cs := dial(t, serveRes(t, b, session.ModeSession, 2000, mcpserver.ResourceOptions{InlineBytes: 200 << 10}))
		res := call(t, cs, "run_python", map[string]any{"code": chartCode})
		if res.IsError {
			t.Fatal(text(res))
		}
		imgs, ls := images(res), links(res)
		if len(imgs) != 1 || len(imgs[0].Data) > 200<<10 || !bytes.HasPrefix(imgs[0].Data, []byte("\x89PNG")) {
			t.Fatalf("want the small chart as one PNG image block, got %d images", len(imgs))
		}
		if len(ls) != 1 {
			t.Fatalf("want the big image as one link, got %d: %q", len(ls), text(res))
		}
		l := ls[0]
		if !strings.HasPrefix(l.URI, "kiln://") || l.MIMEType != "image/png" || l.Size == nil || *l.Size <= 200<<10 {
			t.Fatalf("link %+v", l)
		}
		if !strings.Contains(text(res), l.URI) {
			t.Errorf("the text does not name %s: %q", l.URI, text(res))
		}
		c, err := readRes(t, cs, l.URI)
		if err != nil {
			t.Fatal(err)
		}
		if got := body(c); int64(len(got)) != *l.Size || !bytes.HasPrefix(got, []byte("\x89PNG")) || c.MIMEType != "image/png" {
			t.Errorf("read %d bytes (%s), link says %d", len(got), c.MIMEType, *l.Size)
		}
		list, err := cs.ListResources(context.Background(), nil)
		if err != nil || len(list.Resources) != 1 || list.Resources[0].URI != l.URI || list.CacheScope != "private" {
			t.Errorf("resources/list: %v %+v", err, list)
		}
		tmpls, err := cs.ListResourceTemplates(context.Background(), nil)
		if err != nil || len(tmpls.ResourceTemplates) != 2 {
			t.Errorf("resources/templates/list: %v %+v", err, tmpls)
		}
	})
}

// TestCutOutputAsResource: output over what a result shows is cut there,
// the note names the URI, and the URI holds all of it.
func TestCutOutputAsResource(t *testing.T) {
	onBackends(t, func(t *testing.T, b sandbox.Backend) {
		cs := dial(t, serveRes(t, b, session.ModeSession, 1<<20, mcpserver.ResourceOptions{InlineOutput: 2000}))
		res := call(t, cs, "run_shell", map[string]any{"command": "seq 1 30000; seq 5 7 >&2"})
		var want strings.Builder
		for i := 1; i <= 30000; i++ {
			fmt.Fprintf(&want, "%d\n", i)
		}
		ls := links(res)
		if res.IsError || len(ls) != 1 || ls[0].Name != "stdout" {
			t.Fatalf("want one link to stdout: %d links, %q", len(ls), text(res))
		}
		if tx := text(res); !strings.Contains(tx, "read the rest at "+ls[0].URI) || len(tx) > 4000 || !strings.Contains(tx, "stderr:\n5\n6\n7") {
			t.Errorf("the text: %.3000q", tx)
		}
		if sc, _ := res.StructuredContent.(map[string]any); sc == nil || len(sc["stdout"].(string)) > 2000 {
			t.Errorf("structuredContent stdout is not cut")
		}
		c, err := readRes(t, cs, ls[0].URI)
		if err != nil {
			t.Fatal(err)
		}
		if c.Text != want.String() || c.MIMEType != "text/plain" {
			t.Errorf("the resource holds %d bytes (%s), want all %d", len(c.Text), c.MIMEType, want.Len())
		}
	})
}

const bigFileCode = `
import hashlib, os
data = os.urandom(20 << 20)
open("big.bin", "wb").write(data)
print(hashlib.sha256(data).hexdigest())
`

// TestBigFileReadExact: read_file of a 20 MiB file answers with a link,
// and resources/read of it returns every byte (in several reads of the
// box: one is at most agentproto.MaxRead).
func TestBigFileReadExact(t *testing.T) {
	onBackends(t, func(t *testing.T, b sandbox.Backend) {
		srv := serveRes(t, b, session.ModeSession, 2000, mcpserver.ResourceOptions{})
		cs := dialBig(t, srv)
		res := call(t, cs, "run_python", map[string]any{"code": bigFileCode, "session": "big"})
		sum := strings.TrimSpace(strings.TrimPrefix(text(res), "[session: big, new sandbox]"))
		if res.IsError || len(sum) != 64 {
			t.Fatal(text(res))
		}
		res = call(t, cs, "read_file", map[string]any{"path": "big.bin", "session": "big"})
		ls := links(res)
		if res.IsError || len(ls) != 1 || ls[0].URI != "kiln://big/files/big.bin" || *ls[0].Size != 20<<20 {
			t.Fatalf("want a link to kiln://big/files/big.bin: %q %+v", text(res), ls)
		}
		if raw := fmt.Sprint(res.Content); len(raw) > 64<<10 {
			t.Errorf("the result carries %d bytes", len(raw))
		}
		c, err := readRes(t, cs, ls[0].URI)
		if err != nil {
			t.Fatal(err)
		}
		got := sha256.Sum256(c.Blob)
		if len(c.Blob) != 20<<20 || hex.EncodeToString(got[:]) != sum {
			t.Errorf("read %d bytes with sha256 %x, want %d bytes with %s", len(c.Blob), got, 20<<20, sum)
		}
		// A client that takes no message over 16 MiB reads it in parts.
		small := dial(t, srv)
		h := sha256.New()
		for off := 0; off < 20<<20; off += 8 << 20 {
			c, err := readRes(t, small, fmt.Sprintf("%s?offset=%d&length=%d", ls[0].URI, off, 8<<20))
			if err != nil {
				t.Fatalf("part at %d: %v", off, err)
			}
			if want := min(8<<20, 20<<20-off); len(c.Blob) != want || c.Meta["kiln/size"] != float64(20<<20) {
				t.Fatalf("part at %d: %d bytes, want %d; meta %v", off, len(c.Blob), want, c.Meta)
			}
			h.Write(c.Blob)
		}
		if got := hex.EncodeToString(h.Sum(nil)); got != sum {
			t.Errorf("the parts have sha256 %s, want %s", got, sum)
		}
		for _, bad := range []string{ls[0].URI + "?length=" + fmt.Sprint(9<<20), ls[0].URI + "?offset=-1", ls[0].URI + "?evil=1", "kiln://big/files/../etc/passwd", "kiln://big/files/nope", "kiln://other/files/big.bin", "kiln://big/files/%2e%2e/%2e%2e/etc/passwd"} {
			if c, err := readRes(t, cs, bad); err == nil {
				t.Errorf("%s: read %d bytes", bad, len(body(c)))
			}
		}
	})
}

// TestResourcesDieWithSession: a reset session's outputs and files are
// gone from resources/read and resources/list.
func TestResourcesDieWithSession(t *testing.T) {
	onBackends(t, func(t *testing.T, b sandbox.Backend) {
		cs := dial(t, serveRes(t, b, session.ModeSession, 1<<20, mcpserver.ResourceOptions{InlineOutput: 100, InlineBytes: 1000}))
		res := call(t, cs, "run_shell", map[string]any{"command": "seq 1 1000; seq 1 1000 > f.txt", "session": "s"})
		out := links(res)
		res = call(t, cs, "read_file", map[string]any{"path": "f.txt", "session": "s"})
		file := links(res)
		if len(out) != 1 || len(file) != 1 {
			t.Fatalf("links: %d and %d", len(out), len(file))
		}
		for _, l := range []*mcp.ResourceLink{out[0], file[0]} {
			if _, err := readRes(t, cs, l.URI); err != nil {
				t.Fatalf("%s before the reset: %v", l.URI, err)
			}
		}
		call(t, cs, "reset_session", map[string]any{"session": "s"})
		for _, l := range []*mcp.ResourceLink{out[0], file[0]} {
			if c, err := readRes(t, cs, l.URI); err == nil {
				t.Errorf("%s after the reset: read %d bytes", l.URI, len(body(c)))
			}
		}
		// A new session of the same name does not bring the old call back.
		call(t, cs, "run_shell", map[string]any{"command": "true", "session": "s"})
		if c, err := readRes(t, cs, out[0].URI); err == nil {
			t.Errorf("%s in the new session: read %d bytes", out[0].URI, len(body(c)))
		}
		list, err := cs.ListResources(context.Background(), nil)
		if err != nil || len(list.Resources) != 0 {
			t.Errorf("resources/list after the reset: %v %+v", err, list.Resources)
		}
	})
}

// TestPerCallFileLinked: in per-call mode a produced file over the
// threshold comes back as a link the server holds after the box is gone.
func TestPerCallFileLinked(t *testing.T) {
	onBackends(t, func(t *testing.T, b sandbox.Backend) {
		cs := dial(t, serveRes(t, b, session.ModePerCall, 2000, mcpserver.ResourceOptions{InlineBytes: 1000}))
		res := call(t, cs, "run_shell", map[string]any{"command": "seq 1 2000 > out.txt; echo hi > small.txt"})
		ls := links(res)
		if res.IsError || len(ls) != 1 || !strings.HasPrefix(ls[0].URI, "kiln://per-call/calls/") || !strings.HasSuffix(ls[0].URI, "/files/out.txt") {
			t.Fatalf("%q %+v", text(res), ls)
		}
		if !strings.Contains(text(res), "file small.txt (3 bytes):\nhi") {
			t.Errorf("the small file is not inline: %q", text(res))
		}
		c, err := readRes(t, cs, ls[0].URI)
		if err != nil {
			t.Fatal(err)
		}
		if want := seq(2000); c.Text != want {
			t.Errorf("read %d bytes, want %d", len(c.Text), len(want))
		}
	})
}

func seq(n int) string {
	var b strings.Builder
	for i := 1; i <= n; i++ {
		fmt.Fprintf(&b, "%d\n", i)
	}
	return b.String()
}

// TestResourcesPrincipalIsolation: over HTTP, bob cannot read alice's
// URIs, whether they name her default session, a call of hers, or a
// named session bob also has; resources/list shows each only their own.
func TestResourcesPrincipalIsolation(t *testing.T) {
	onBackends(t, func(t *testing.T, b sandbox.Backend) {
		srv := serveRes(t, b, session.ModeSession, 1<<20, mcpserver.ResourceOptions{InlineOutput: 100, InlineBytes: 1000})
		f := serveHTTP(t, srv, testLimits())
		client := func(secret string) *mcp.ClientSession {
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			cs, err := mcp.NewClient(&mcp.Implementation{Name: "t", Version: "1"}, nil).Connect(ctx,
				&mcp.StreamableClientTransport{Endpoint: "http://" + f.addr + "/mcp", HTTPClient: &http.Client{Transport: &countingTransport{token: secret}}}, nil)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { cs.Close() })
			return cs
		}
		alice, bob := client(f.secret), client(strings.Repeat("b", 32))

		var uris []string
		for _, sess := range []string{"", "shared"} {
			args := map[string]any{"command": "echo alice-secret > secret.txt; seq 1 1000 >> secret.txt; seq 1 1000"}
			if sess != "" {
				args["session"] = sess
			}
			res := call(t, alice, "run_shell", args)
			uris = append(uris, links(res)[0].URI)
			args = map[string]any{"path": "secret.txt"}
			if sess != "" {
				args["session"] = sess
			}
			res = call(t, alice, "read_file", args)
			uris = append(uris, links(res)[0].URI)
		}
		// bob has a session called "shared" too, with a file of the same name.
		call(t, bob, "run_shell", map[string]any{"command": "echo bob > secret.txt", "session": "shared"})
		for _, uri := range uris {
			c, err := readRes(t, alice, uri)
			if err != nil || !strings.Contains(string(body(c)), "1000") {
				t.Fatalf("alice reading her own %s: %v", uri, err)
			}
			c, err = readRes(t, bob, uri)
			if err == nil && bytes.Contains(body(c), []byte("alice")) || err == nil && strings.Contains(uri, "/calls/") {
				t.Errorf("bob read alice's %s: %.80q", uri, body(c))
			}
		}
		list, err := bob.ListResources(context.Background(), nil)
		if err != nil || len(list.Resources) != 0 {
			t.Errorf("bob's resources/list: %v %+v", err, list)
		}
		list, err = alice.ListResources(context.Background(), nil)
		if err != nil || len(list.Resources) != len(uris) {
			t.Errorf("alice's resources/list: %v, %d entries, want %d", err, len(list.Resources), len(uris))
		}
	})
}
