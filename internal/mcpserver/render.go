package mcpserver

import (
	"encoding/base64"
	"fmt"
	"path"
	"sort"
	"strings"
	"unicode/utf8"

	"github.com/modelcontextprotocol/go-sdk/mcp"

	"kiln/internal/agentproto"
	"kiln/internal/session"
)

// Caps on what one result carries to the model.
const (
	maxImages     = 8
	maxImageBytes = 4 << 20
	maxInlineText = 8 << 10 // per-call produced text files shown inline
	// maxResultRich bounds the rich output of one result as the client
	// receives it: images as base64, representations as escaped JSON,
	// where HTML's "<" costs six bytes. The SDK's clients refuse a message
	// over 16 MiB; what is beyond is dropped with a note.
	maxResultRich = 10 << 20
)

// richCut spends maxResultRich over one result.
type richCut struct{ left, dropped, total int }

func (c *richCut) take(n int) bool {
	c.total += n
	if n > c.left {
		c.dropped += n
		return false
	}
	c.left -= n
	return true
}

// jsonLen is the length of s as a JSON string, as the SDK encodes it.
func jsonLen(s string) int {
	n := 2
	for i := 0; i < len(s); i++ {
		switch c := s[i]; {
		case c == '<' || c == '>' || c == '&':
			n += 6
		case c == '"' || c == '\\' || c == '\n' || c == '\r' || c == '\t':
			n += 2
		case c < 0x20:
			n += 6
		default:
			n++
		}
	}
	return n
}

// richTypes are kept in structuredContent; images become image blocks.
var richTypes = []string{"text/html", "text/markdown", "image/svg+xml", "text/latex", "application/json"}

// render turns an outcome into the tool result: a text block a person
// would want to read, one image block per figure, and structuredContent
// with the same facts and the rich representations. No outputSchema is
// advertised, so clients keep the image blocks.
func (s *Server) render(out *session.Outcome, produced []session.Produced) *mcp.CallToolResult {
	return s.renderWith(nil, out, produced)
}

// renderWith renders with link filing what is too big to inline as
// resources (nil: images and files inline; output over what a result
// shows is cut all the same, with no URI for the rest).
func (s *Server) renderWith(link *callLinks, out *session.Outcome, produced []session.Produced) *mcp.CallToolResult {
	res := out.ExecResult
	if res == nil {
		res = &agentproto.ExecResult{}
	}
	r := &rendering{cut: richCut{left: maxResultRich}, link: link}
	if s.res != nil {
		r.inline, r.inlineOutput = s.res.opts.InlineBytes, s.res.opts.InlineOutput
	}
	res, outURI, errURI := r.streams(res)
	if out.Session != "" {
		fmt.Fprintf(&r.text, "[session: %s", out.Session)
		if out.Fresh {
			r.text.WriteString(", new sandbox")
		}
		r.text.WriteString("]\n")
	}
	writeStreamAt(&r.text, "", res.Stdout, outURI)
	writeStreamAt(&r.text, "stderr:\n", res.Stderr, errURI)

	var displays []map[string]string
	for _, d := range res.Displays {
		displays = append(displays, r.bundle(d))
	}
	var result map[string]string
	if len(res.Result) > 0 {
		r.text.WriteString("Out: ")
		result = r.bundle(res.Result)
	}
	r.status(out, res)
	files := r.files(produced)
	if r.cut.dropped > 0 {
		r.notes = append(r.notes, fmt.Sprintf("dropped %d of %d bytes of rich output (at most %d MiB per result)", r.cut.dropped, r.cut.total, maxResultRich>>20))
	}
	r.notes = append(r.notes, res.Notes...)
	if out.Note != "" {
		r.notes = append(r.notes, out.Note)
	}
	for _, n := range r.notes {
		fmt.Fprintf(&r.text, "[kiln: %s]\n", n)
	}
	sc := structured(out, res, result, displays, files, r.notes)
	if len(r.resources) > 0 {
		sc["resources"] = r.resources
	}
	return &mcp.CallToolResult{
		Content:           append([]mcp.Content{&mcp.TextContent{Text: strings.TrimRight(r.text.String(), "\n")}}, r.images...),
		StructuredContent: sc,
		IsError:           res.Error != nil || res.ExitCode != 0 || res.Signal != "" || out.TimedOut,
	}
}

// rendering is one tool result being built: its text block, its image
// and resource blocks, its notes for the model, and the rich output
// budget they share.
type rendering struct {
	text   strings.Builder
	images []mcp.Content
	notes  []string
	cut    richCut

	// link files what is too big to inline (nil: nothing is filed):
	// images and files over inline bytes, streams over inlineOutput.
	link                 *callLinks
	inline, inlineOutput int
	nImages              int
	resources            []map[string]any // structuredContent entries of the links
}

// addImage adds an image block, or a note saying why it was dropped.
func (r *rendering) addImage(mime, b64 string) {
	if r.linkImage(mime, b64) {
		return
	}
	if !r.cut.take(len(b64)) {
		return
	}
	data, err := base64.StdEncoding.DecodeString(b64)
	switch {
	case err != nil:
		r.notes = append(r.notes, "an image could not be decoded")
	case len(r.images) >= maxImages:
		r.notes = append(r.notes, fmt.Sprintf("image dropped: only %d images per result", maxImages))
	case len(data) > maxImageBytes:
		r.notes = append(r.notes, fmt.Sprintf("image dropped: %d bytes is over the %d byte cap", len(data), maxImageBytes))
	default:
		r.images = append(r.images, &mcp.ImageContent{MIMEType: mime, Data: data})
	}
}

// status writes how the code ended: its exception, "(no output)" for a
// per-call run that printed nothing, the signal or exit status.
func (r *rendering) status(out *session.Outcome, res *agentproto.ExecResult) {
	if e := res.Error; e != nil {
		if e.Traceback != "" {
			r.text.WriteString(strings.TrimRight(e.Traceback, "\n") + "\n")
		} else {
			fmt.Fprintf(&r.text, "%s: %s\n", e.Name, e.Value)
		}
	}
	if res.Error == nil && out.Session == "" && res.ExitCode == 0 && res.Stdout.Total == 0 && res.Stderr.Total == 0 && len(res.Result) == 0 && len(res.Displays) == 0 {
		r.text.WriteString("(no output)\n")
	}
	if res.Signal != "" && res.Error == nil {
		fmt.Fprintf(&r.text, "killed by %s\n", res.Signal)
	} else if res.ExitCode != 0 {
		fmt.Fprintf(&r.text, "exit status %d\n", res.ExitCode)
	}
}

// files shows the files a per-call run produced: images as image blocks,
// small text inline, other content as a resource while the budget lasts;
// it returns their structuredContent entries.
func (r *rendering) files(produced []session.Produced) []map[string]any {
	var files []map[string]any
	for _, p := range produced {
		f := map[string]any{"path": p.Path, "size": p.Size}
		if l, ok := r.linkFile(p); ok {
			f["uri"] = l.URI
			files = append(files, f)
			continue
		}
		switch mime := imageMIME(p.Path, p.Data); {
		case mime != "":
			r.addImage(mime, base64.StdEncoding.EncodeToString(p.Data))
			fmt.Fprintf(&r.text, "file %s (%d bytes, image below)\n", p.Path, p.Size)
		case p.Data != nil && len(p.Data) <= maxInlineText && utf8.Valid(p.Data):
			fmt.Fprintf(&r.text, "file %s (%d bytes):\n%s\n", p.Path, p.Size, strings.TrimRight(string(p.Data), "\n"))
			f["text"] = string(p.Data)
		case p.Data != nil && r.cut.take(base64.StdEncoding.EncodedLen(len(p.Data))):
			fmt.Fprintf(&r.text, "file %s (%d bytes, base64 in a resource)\n", p.Path, p.Size)
			r.images = append(r.images, &mcp.EmbeddedResource{Resource: &mcp.ResourceContents{
				URI: "file://" + path.Join(workspace, p.Path), MIMEType: "application/octet-stream", Blob: p.Data,
			}})
		case p.Data != nil:
			fmt.Fprintf(&r.text, "file %s (%d bytes, over the result's %d MiB of rich output)\n", p.Path, p.Size, maxResultRich>>20)
		default:
			fmt.Fprintf(&r.text, "file %s (%d bytes, %s)\n", p.Path, p.Size, p.Skipped)
		}
		files = append(files, f)
	}
	return files
}

// structured is the result's structuredContent: the facts of the text
// block, and the rich representations it only mentions.
func structured(out *session.Outcome, res *agentproto.ExecResult, result map[string]string, displays []map[string]string, files []map[string]any, notes []string) map[string]any {
	structured := map[string]any{
		"stdout":      res.Stdout.Text,
		"stderr":      res.Stderr.Text,
		"duration_ms": out.Duration.Milliseconds(),
	}
	if out.Session != "" {
		structured["session"] = out.Session
	}
	if result != nil {
		structured["result"] = result
	}
	if len(displays) > 0 {
		structured["displays"] = displays
	}
	if res.Error != nil {
		structured["error"] = map[string]string{"ename": res.Error.Name, "evalue": res.Error.Value, "traceback": res.Error.Traceback}
	}
	if res.ExitCode != 0 || res.Signal != "" {
		structured["exit_code"] = res.ExitCode
	}
	if out.TimedOut {
		structured["timed_out"] = true
	}
	if out.Restarted {
		structured["restarted"] = true
	}
	if len(files) > 0 {
		structured["files"] = files
	}
	if len(notes) > 0 {
		structured["notes"] = notes
	}
	return structured
}

// bundle writes a mime bundle's text form, adds its images and returns
// the representations kept in structuredContent.
func (r *rendering) bundle(b agentproto.MimeBundle) map[string]string {
	kept := map[string]string{}
	hasImage := false
	for _, mime := range []string{"image/png", "image/jpeg", "image/gif", "image/webp"} {
		if v, ok := b[mime]; ok {
			r.addImage(mime, v)
			hasImage = true
		}
	}
	plain := b["text/plain"]
	if plain != "" && !r.cut.take(2*jsonLen(plain)) { // in the text block and in structuredContent
		plain = ""
	}
	for _, mime := range richTypes {
		if v, ok := b[mime]; ok && r.cut.take(jsonLen(v)) {
			kept[mime] = v
		}
	}
	if plain != "" {
		kept["text/plain"] = plain
	}
	switch {
	case hasImage:
		fmt.Fprintf(&r.text, "%s (image below)\n", firstLine(plain, "<image>"))
	case plain != "":
		r.text.WriteString(strings.TrimRight(plain, "\n") + "\n")
	case kept["text/markdown"] != "":
		r.text.WriteString(kept["text/markdown"] + "\n")
	}
	if note := b["text/x-kiln-note"]; note != "" {
		r.text.WriteString("[kiln: " + strings.TrimSpace(note) + "]\n")
	}
	var extra []string
	for mime := range kept {
		if mime != "text/plain" {
			extra = append(extra, mime)
		}
	}
	if len(extra) > 0 {
		sort.Strings(extra)
		fmt.Fprintf(&r.text, "[also as %s in structuredContent]\n", strings.Join(extra, ", "))
	}
	return kept
}

func firstLine(s, fallback string) string {
	if s == "" {
		return fallback
	}
	line, _, _ := strings.Cut(s, "\n")
	return line
}

// writeStreamAt writes captured output, marking where it was cut.
// AgentConn has validated the stream; a cut out of range is still ignored
// here rather than trusted.
// The truncation note names the URI that holds what the result does not
// show (uri "": none).
func writeStreamAt(b *strings.Builder, label string, st agentproto.Stream, uri string) {
	if st.Total == 0 {
		return
	}
	b.WriteString(label)
	t := strings.ToValidUTF8(st.Text, "\uFFFD")
	if dropped := st.Truncated(); dropped > 0 && st.Cut >= 0 && st.Cut <= len(st.Text) {
		head, tail := strings.ToValidUTF8(st.Text[:st.Cut], "\uFFFD"), strings.ToValidUTF8(st.Text[st.Cut:], "\uFFFD")
		where := ""
		if uri != "" {
			where = "; read the rest at " + uri
		}
		t = head + fmt.Sprintf("\n[… truncated %d of %d bytes%s …]\n", dropped, st.Total, where) + tail
	}
	b.WriteString(t)
	if !strings.HasSuffix(t, "\n") {
		b.WriteString("\n")
	}
}
