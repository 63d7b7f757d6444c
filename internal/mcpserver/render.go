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
)

// richTypes are kept in structuredContent; images become image blocks.
var richTypes = []string{"text/html", "text/markdown", "image/svg+xml", "text/latex", "application/json"}

// render turns an outcome into the tool result: a text block a person
// would want to read, one image block per figure, and structuredContent
// with the same facts and the rich representations. No outputSchema is
// advertised, so clients keep the image blocks.
func (s *Server) render(out *session.Outcome, produced []session.Produced) *mcp.CallToolResult {
	res := out.ExecResult
	if res == nil {
		res = &agentproto.ExecResult{}
	}
	var text strings.Builder
	if out.Session != "" {
		fmt.Fprintf(&text, "[session: %s", out.Session)
		if out.Fresh {
			text.WriteString(", new sandbox")
		}
		text.WriteString("]\n")
	}
	writeStream(&text, "", res.Stdout)
	writeStream(&text, "stderr:\n", res.Stderr)

	var images []mcp.Content
	var notes []string
	addImage := func(mime, b64 string) {
		data, err := base64.StdEncoding.DecodeString(b64)
		switch {
		case err != nil:
			notes = append(notes, "an image could not be decoded")
		case len(images) >= maxImages:
			notes = append(notes, fmt.Sprintf("image dropped: only %d images per result", maxImages))
		case len(data) > maxImageBytes:
			notes = append(notes, fmt.Sprintf("image dropped: %d bytes is over the %d byte cap", len(data), maxImageBytes))
		default:
			images = append(images, &mcp.ImageContent{MIMEType: mime, Data: data})
		}
	}
	var displays []map[string]string
	for _, d := range res.Displays {
		displays = append(displays, s.bundle(d, &text, addImage))
	}
	var result map[string]string
	if len(res.Result) > 0 {
		text.WriteString("Out: ")
		result = s.bundle(res.Result, &text, addImage)
	}
	if e := res.Error; e != nil {
		if e.Traceback != "" {
			text.WriteString(strings.TrimRight(e.Traceback, "\n") + "\n")
		} else {
			fmt.Fprintf(&text, "%s: %s\n", e.Name, e.Value)
		}
	}
	if res.Error == nil && out.Session == "" && res.ExitCode == 0 && res.Stdout.Total == 0 && res.Stderr.Total == 0 && len(res.Result) == 0 && len(res.Displays) == 0 {
		text.WriteString("(no output)\n")
	}
	if res.Signal != "" && res.Error == nil {
		fmt.Fprintf(&text, "killed by %s\n", res.Signal)
	} else if res.ExitCode != 0 {
		fmt.Fprintf(&text, "exit status %d\n", res.ExitCode)
	}
	var files []map[string]any
	for _, p := range produced {
		f := map[string]any{"path": p.Path, "size": p.Size}
		switch mime := imageMIME(p.Path, p.Data); {
		case mime != "":
			addImage(mime, base64.StdEncoding.EncodeToString(p.Data))
			fmt.Fprintf(&text, "file %s (%d bytes, image below)\n", p.Path, p.Size)
		case p.Data != nil && len(p.Data) <= maxInlineText && utf8.Valid(p.Data):
			fmt.Fprintf(&text, "file %s (%d bytes):\n%s\n", p.Path, p.Size, strings.TrimRight(string(p.Data), "\n"))
			f["text"] = string(p.Data)
		case p.Data != nil:
			fmt.Fprintf(&text, "file %s (%d bytes, base64 in a resource)\n", p.Path, p.Size)
			images = append(images, &mcp.EmbeddedResource{Resource: &mcp.ResourceContents{
				URI: "file://" + path.Join(workspace, p.Path), MIMEType: "application/octet-stream", Blob: p.Data,
			}})
		default:
			fmt.Fprintf(&text, "file %s (%d bytes, too large to return)\n", p.Path, p.Size)
		}
		files = append(files, f)
	}
	if out.Note != "" {
		notes = append(notes, out.Note)
	}
	for _, n := range notes {
		fmt.Fprintf(&text, "[kiln: %s]\n", n)
	}

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
	return &mcp.CallToolResult{
		Content:           append([]mcp.Content{&mcp.TextContent{Text: strings.TrimRight(text.String(), "\n")}}, images...),
		StructuredContent: structured,
		IsError:           res.Error != nil || res.ExitCode != 0 || res.Signal != "" || out.TimedOut,
	}
}

// bundle writes a mime bundle's text form, sends its images to addImage
// and returns the representations kept in structuredContent.
func (s *Server) bundle(b agentproto.MimeBundle, text *strings.Builder, addImage func(mime, b64 string)) map[string]string {
	kept := map[string]string{}
	hasImage := false
	for _, mime := range []string{"image/png", "image/jpeg", "image/gif", "image/webp"} {
		if v, ok := b[mime]; ok {
			addImage(mime, v)
			hasImage = true
		}
	}
	for _, mime := range richTypes {
		if v, ok := b[mime]; ok {
			kept[mime] = v
		}
	}
	plain := b["text/plain"]
	if plain != "" {
		kept["text/plain"] = plain
	}
	switch {
	case hasImage:
		fmt.Fprintf(text, "%s (image below)\n", firstLine(plain, "<image>"))
	case plain != "":
		text.WriteString(strings.TrimRight(plain, "\n") + "\n")
	case b["text/markdown"] != "":
		text.WriteString(b["text/markdown"] + "\n")
	}
	if note := b["text/x-kiln-note"]; note != "" {
		text.WriteString("[kiln: " + strings.TrimSpace(note) + "]\n")
	}
	var extra []string
	for mime := range kept {
		if mime != "text/plain" {
			extra = append(extra, mime)
		}
	}
	if len(extra) > 0 {
		sort.Strings(extra)
		fmt.Fprintf(text, "[also as %s in structuredContent]\n", strings.Join(extra, ", "))
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

// writeStream writes captured output, marking where the agent cut it.
func writeStream(b *strings.Builder, label string, st agentproto.Stream) {
	if st.Total == 0 {
		return
	}
	b.WriteString(label)
	t := strings.ToValidUTF8(st.Text, "\uFFFD")
	if dropped := st.Truncated(); dropped > 0 && st.Cut <= len(st.Text) {
		head, tail := strings.ToValidUTF8(st.Text[:st.Cut], "\uFFFD"), strings.ToValidUTF8(st.Text[st.Cut:], "\uFFFD")
		t = head + fmt.Sprintf("\n[… truncated %d of %d bytes …]\n", dropped, st.Total) + tail
	}
	b.WriteString(t)
	if !strings.HasSuffix(t, "\n") {
		b.WriteString("\n")
	}
}
