package mcpserver

import (
	"encoding/base64"
	"fmt"
	"strings"
	"unicode/utf8"

	"github.com/modelcontextprotocol/go-sdk/mcp"

	"kiln/internal/agentproto"
	"kiln/internal/session"
)

// renderCall renders a run call's outcome, filing what is too big to
// inline as the caller's resources.
func (s *Server) renderCall(req *mcp.CallToolRequest, out *session.Outcome, produced []session.Produced) *mcp.CallToolResult {
	return s.renderWith(s.linksFor(req, out.Session), out, produced)
}

// linked records that a block links to a resource: the block, its line
// in the text, its entry in structuredContent.
func (r *rendering) linked(what string, l *mcp.ResourceLink) {
	r.images = append(r.images, l)
	r.resources = append(r.resources, map[string]any{"uri": l.URI, "name": l.Name, "mime": l.MIMEType, "size": *l.Size})
	r.text.WriteString("[" + summary(what, l) + "]\n")
}

// linkImage files a decoded image too large to inline; it reports false
// when it is small enough, or the server cannot hold it.
func (r *rendering) linkImage(mime, b64 string) bool {
	if r.link == nil || base64.StdEncoding.DecodedLen(len(b64)) <= r.inline {
		return false
	}
	data, err := base64.StdEncoding.DecodeString(b64)
	if err != nil {
		return false
	}
	r.nImages++
	name := fmt.Sprintf("display-%d.%s", r.nImages, strings.TrimPrefix(strings.TrimPrefix(mime, "image/"), "x-"))
	l := r.link.hold(name, mime, data)
	if l == nil {
		return false
	}
	r.linked("image "+name, l)
	return true
}

// linkFile files a per-call produced file too large to inline.
func (r *rendering) linkFile(p session.Produced) (*mcp.ResourceLink, bool) {
	if r.link == nil || p.Data == nil || len(p.Data) <= r.inline {
		return nil, false
	}
	l := r.link.hold("files/"+strings.TrimPrefix(p.Path, "/"), mimeOf(p.Path, p.Data), p.Data)
	if l == nil {
		return nil, false
	}
	r.linked("file "+p.Path, l)
	return l, true
}

// streams cuts stdout and stderr to what a result shows, filing what was
// kept of each as a resource when it holds more than that (and r files). It returns the
// result with the cut streams and the URI of each filed stream.
func (r *rendering) streams(res *agentproto.ExecResult) (_ *agentproto.ExecResult, outURI, errURI string) {
	if r.inlineOutput <= 0 {
		return res, "", ""
	}
	cp := *res
	cp.Stdout, outURI = r.stream("stdout", res.Stdout)
	cp.Stderr, errURI = r.stream("stderr", res.Stderr)
	return &cp, outURI, errURI
}

func (r *rendering) stream(name string, st agentproto.Stream) (agentproto.Stream, string) {
	shown := cutStream(st, r.inlineOutput)
	if len(shown.Text) == len(st.Text) || r.link == nil {
		return shown, ""
	}
	l := r.link.hold(name, "text/plain", []byte(keptText(st)))
	if l == nil {
		return shown, ""
	}
	r.images = append(r.images, l)
	r.resources = append(r.resources, map[string]any{"uri": l.URI, "name": l.Name, "mime": l.MIMEType, "size": *l.Size})
	return shown, l.URI
}

// keptText is what the box kept of a stream, with a marker where it
// dropped bytes.
func keptText(st agentproto.Stream) string {
	if d := st.Truncated(); d > 0 && st.Cut >= 0 && st.Cut <= len(st.Text) {
		return st.Text[:st.Cut] + fmt.Sprintf("\n[… %d bytes not kept: the sandbox keeps the first and last %d …]\n", d, len(st.Text)/2) + st.Text[st.Cut:]
	}
	return st.Text
}

// cutStream keeps at most n bytes of st's text, head and tail, on rune
// boundaries, within the head and tail the box kept.
func cutStream(st agentproto.Stream, n int) agentproto.Stream {
	if n <= 0 || len(st.Text) <= n {
		return st
	}
	t := st.Text
	headEnd, tailStart := n/2, len(t)-(n-n/2)
	if st.Truncated() > 0 && st.Cut >= 0 && st.Cut <= len(t) {
		headEnd, tailStart = min(headEnd, st.Cut), max(tailStart, st.Cut)
	}
	for headEnd > 0 && !utf8.RuneStart(t[headEnd]) {
		headEnd--
	}
	for tailStart < len(t) && !utf8.RuneStart(t[tailStart]) {
		tailStart++
	}
	return agentproto.Stream{Text: t[:headEnd] + t[tailStart:], Total: st.Total, Cut: headEnd}
}

// linkedFileResult answers read_file for a file over the inline limit: a
// link to it as a resource, a line of text naming it, and for text the
// head of it.
func (s *Server) linkedFileResult(req *mcp.CallToolRequest, sess *session.Session, p string, head []byte, size int64) *mcp.CallToolResult {
	mime := mimeOf(p, trimPartialRune(head))
	l := s.res.linkFile(principalOf(req.Extra), sess, p, mime, size)
	var b strings.Builder
	fmt.Fprintf(&b, "[session: %s] %s (%d bytes) is over the %d KiB shown inline; %s", sess.Name(), p, size, s.res.opts.InlineBytes>>10, summary("it", l))
	if size > maxPart {
		fmt.Fprintf(&b, ". A client that takes no message over 16 MiB can read it in parts of up to %d bytes: %s?offset=0&length=%d, then offset=%d, …", maxPart, l.URI, maxPart, maxPart)
	}
	if mime == "text/plain" || mime == "text/csv" || mime == "application/json" {
		fmt.Fprintf(&b, "\nits first %d bytes:\n%s", len(head), strings.ToValidUTF8(string(head), "\uFFFD"))
	}
	return &mcp.CallToolResult{
		Content:           []mcp.Content{&mcp.TextContent{Text: b.String()}, l},
		StructuredContent: map[string]any{"session": sess.Name(), "path": p, "size": size, "uri": l.URI, "mime": mime},
	}
}

// trimPartialRune drops an incomplete UTF-8 sequence at the end of a
// head cut from a longer text.
func trimPartialRune(b []byte) []byte {
	for i := 1; i <= utf8.UTFMax-1 && i <= len(b); i++ {
		if utf8.RuneStart(b[len(b)-i]) {
			if !utf8.FullRune(b[len(b)-i:]) {
				return b[:len(b)-i]
			}
			break
		}
	}
	return b
}

// shownOutput is the output per stream a result shows.
func (s *Server) shownOutput() int {
	if n := s.res.opts.InlineOutput; n > 0 {
		return min(n, s.mgr.Options().MaxOutput)
	}
	return s.mgr.Options().MaxOutput
}

// describeResources tells the model what comes back as a link.
func (s *Server) describeResources() string {
	what := "images and files"
	if s.shownOutput() < s.mgr.Options().MaxOutput {
		what = "the rest of cut output (up to " + fmt.Sprint(s.mgr.Options().MaxOutput>>10) + " KiB per stream), images and files"
	}
	return fmt.Sprintf("Over %d KiB, %s come back as kiln:// resource links: read them with resources/read. ", s.res.opts.InlineBytes>>10, what)
}
