package mcpserver_test

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/modelcontextprotocol/go-sdk/mcp"

	"kiln/internal/session"
	"kiln/internal/session/sessiontest"
)

var update = flag.Bool("update", false, "rewrite the golden transcripts under testdata/golden with what the server renders now")

// TestGoldenTranscripts replays each transcript in testdata/golden on a
// fresh server over the in-process backend and compares what the client
// receives with what the transcript says, byte for byte. A transcript is
// a txtar archive: its comment holds "mode: session" or "mode: per-call";
// each "call <tool>" file holds the call's arguments as JSON and is
// followed by a "result" file with the rendered result (isError, each
// content block, structuredContent with its duration scrubbed).
// go test -run TestGoldenTranscripts -update rewrites the results.
func TestGoldenTranscripts(t *testing.T) {
	paths, err := filepath.Glob("testdata/golden/*.txtar")
	if err != nil || len(paths) == 0 {
		t.Fatalf("no transcripts: %v", err)
	}
	python := sessiontest.Python(t)
	for _, path := range paths {
		t.Run(strings.TrimSuffix(filepath.Base(path), ".txtar"), func(t *testing.T) {
			data, err := os.ReadFile(path)
			if err != nil {
				t.Fatal(err)
			}
			ar := parseTxtar(data)
			mode := session.ModeSession
			if strings.Contains(ar.comment, "mode: per-call") {
				mode = session.ModePerCall
			}
			b := sessiontest.New(t, &sessiontest.Options{Python: python})
			cs := dial(t, serve(t, b, session.Options{
				Mode: mode, DefaultTimeout: 20 * time.Second, MaxOutput: 200, Grace: 500 * time.Millisecond,
			}))
			var out []txtarFile
			for i := 0; i < len(ar.files); i++ {
				f := ar.files[i]
				tool, ok := strings.CutPrefix(f.name, "call ")
				if !ok {
					t.Fatalf("file %q where a call was expected", f.name)
				}
				var args map[string]any
				if err := json.Unmarshal(f.data, &args); err != nil {
					t.Fatalf("%s: %v", f.name, err)
				}
				got := renderTranscript(t, call(t, cs, tool, args))
				out = append(out, f, txtarFile{"result", got})
				if i+1 < len(ar.files) && ar.files[i+1].name == "result" {
					i++
					if want := ar.files[i].data; !*update && !bytes.Equal(got, want) {
						t.Errorf("%s %s: the result differs from the transcript (go test -run TestGoldenTranscripts -update rewrites it)\ngot:\n%s\nwant:\n%s", f.name, bytes.TrimSpace(f.data), got, want)
					}
				} else if !*update {
					t.Errorf("%s has no result in the transcript (go test -run TestGoldenTranscripts -update writes it)", f.name)
				}
			}
			if *update {
				if err := os.WriteFile(path, formatTxtar(ar.comment, out), 0o644); err != nil {
					t.Fatal(err)
				}
			}
		})
	}
}

// renderTranscript is a tool result as a transcript shows it.
func renderTranscript(t *testing.T, res *mcp.CallToolResult) []byte {
	var b bytes.Buffer
	fmt.Fprintf(&b, "isError: %v\n", res.IsError)
	for _, c := range res.Content {
		switch c := c.(type) {
		case *mcp.TextContent:
			fmt.Fprintf(&b, "[text]\n%s\n", c.Text)
		case *mcp.ImageContent:
			fmt.Fprintf(&b, "[image %s, %d bytes]\n%s\n", c.MIMEType, len(c.Data), base64.StdEncoding.EncodeToString(c.Data))
		case *mcp.EmbeddedResource:
			fmt.Fprintf(&b, "[resource %s %s, %d bytes]\n%s\n", c.Resource.URI, c.Resource.MIMEType, len(c.Resource.Blob), base64.StdEncoding.EncodeToString(c.Resource.Blob))
		default:
			fmt.Fprintf(&b, "[%T]\n", c)
		}
	}
	if res.StructuredContent != nil {
		// Through JSON, as the client receives it.
		raw, err := json.Marshal(res.StructuredContent)
		if err != nil {
			t.Fatal(err)
		}
		var sc map[string]any
		if err := json.Unmarshal(raw, &sc); err != nil {
			t.Fatal(err)
		}
		if _, ok := sc["duration_ms"]; ok {
			sc["duration_ms"] = "(scrubbed)"
		}
		js, err := json.MarshalIndent(sc, "", "  ")
		if err != nil {
			t.Fatal(err)
		}
		fmt.Fprintf(&b, "[structuredContent]\n%s\n", js)
	}
	return b.Bytes()
}

// A txtar archive (golang.org/x/tools/txtar's format): a comment, then
// files, each introduced by a "-- name --" line.
type txtarFile struct {
	name string
	data []byte
}

type txtar struct {
	comment string
	files   []txtarFile
}

func parseTxtar(data []byte) txtar {
	var ar txtar
	var comment []byte
	cur := &comment
	for line := range bytes.Lines(data) {
		if s := strings.TrimRight(string(line), "\n"); strings.HasPrefix(s, "-- ") && strings.HasSuffix(s, " --") && len(s) >= 6 {
			ar.files = append(ar.files, txtarFile{name: strings.TrimSpace(s[3 : len(s)-3])})
			cur = &ar.files[len(ar.files)-1].data
			continue
		}
		*cur = append(*cur, line...)
	}
	ar.comment = string(comment)
	return ar
}

func formatTxtar(comment string, files []txtarFile) []byte {
	var b bytes.Buffer
	b.WriteString(comment)
	for _, f := range files {
		fmt.Fprintf(&b, "-- %s --\n", f.name)
		b.Write(f.data)
		if len(f.data) > 0 && f.data[len(f.data)-1] != '\n' {
			b.WriteByte('\n')
		}
	}
	return b.Bytes()
}

func TestTxtarRoundTrip(t *testing.T) {
	in := "mode: session\n-- call run_shell --\n{\"command\": \"echo\"}\n-- result --\nisError: false\n[text]\n-- not a marker\n"
	ar := parseTxtar([]byte(in))
	if ar.comment != "mode: session\n" || len(ar.files) != 2 || ar.files[0].name != "call run_shell" || string(ar.files[1].data) != "isError: false\n[text]\n-- not a marker\n" {
		t.Fatalf("parsed %+v", ar)
	}
	if out := string(formatTxtar(ar.comment, ar.files)); out != in {
		t.Errorf("round trip:\n%s", out)
	}
}
