package agentproto

import (
	"bytes"
	"encoding/binary"
	"strings"
	"testing"
)

func decodeBody(t *testing.T, body string) (*Response, error) {
	t.Helper()
	var buf bytes.Buffer
	binary.Write(&buf, binary.BigEndian, uint32(len(body)))
	buf.WriteString(body)
	var r Response
	err := ReadFrame(&buf, &r)
	return &r, err
}

// TestCheck is the table of what the host refuses from a box, field by
// field, next to what it accepts.
func TestCheck(t *testing.T) {
	execReq := &Request{ID: 1, Op: OpPython, MaxOutput: 100}
	liveReq := &Request{ID: 1, Op: OpShell, MaxOutput: 100, Live: true}
	st := func(text string, total int64, cut int) Stream { return Stream{Text: text, Total: total, Cut: cut} }
	ex := func(e ExecResult) *Response { return &Response{ID: 1, Exec: &e} }
	cases := []struct {
		name  string
		req   *Request
		resp  *Response
		fault string // "" when accepted
	}{
		{"honest exec", execReq, ex(ExecResult{Stdout: st("hello", 5, 5)}), ""},
		{"honest truncated", execReq, ex(ExecResult{Stdout: st("headtail", 1000, 4)}), ""},
		{"negative cut", execReq, ex(ExecResult{Stdout: st("hello", 10, -1)}), "cut -1"},
		{"cut past the text", execReq, ex(ExecResult{Stderr: st("hello", 10, 6)}), "cut 6"},
		{"negative total", execReq, ex(ExecResult{Stdout: st("", -1, 0)}), "total -1"},
		{"over the cap", execReq, ex(ExecResult{Stdout: st(strings.Repeat("x", 301), 301, 0)}), "cap of 100"},
		{"too many displays", execReq, ex(ExecResult{Displays: make([]MimeBundle, MaxDisplays+1)}), "displays"},
		{"long signal", execReq, ex(ExecResult{Signal: strings.Repeat("S", 300)}), "signal"},
		{"no result", execReq, &Response{ID: 1}, "without a result"},
		{"honest output", liveReq, &Response{ID: 1, Output: &Output{Tail: "line\n", Total: 9}}, ""},
		{"output not asked for", execReq, &Response{ID: 1, Output: &Output{Tail: "x", Total: 1}}, "asked for none"},
		{"output for a read", &Request{ID: 1, Op: OpRead, Live: true}, &Response{ID: 1, Output: &Output{}}, "asked for none"},
		{"output over the cap", liveReq, &Response{ID: 1, Output: &Output{Tail: strings.Repeat("x", MaxLiveTail+1), Total: 1 << 20}}, "tail of"},
		{"output with an answer", liveReq, &Response{ID: 1, Output: &Output{}, Exec: &ExecResult{}}, "carries an answer"},
		{"output total under tail", liveReq, &Response{ID: 1, Output: &Output{Tail: "abc", Total: 2}}, "total 2"},
		{"error instead of a result", execReq, &Response{ID: 1, Error: "kernel died"}, ""},
		{"wrong id", execReq, &Response{ID: 2, Exec: &ExecResult{}}, "answers request 1"},
		{"exec for a read", &Request{ID: 1, Op: OpRead}, ex(ExecResult{}), "exec result"},
		{"data for a list", &Request{ID: 1, Op: OpList}, &Response{ID: 1, Data: []byte("x")}, "file data"},
		{"files for a write", &Request{ID: 1, Op: OpWrite}, &Response{ID: 1, Files: []FileInfo{{Path: "a"}}}, "file list"},
		{"honest read", &Request{ID: 1, Op: OpRead, MaxBytes: 4}, &Response{ID: 1, Data: []byte("abcd"), Size: 10}, ""},
		{"read over max", &Request{ID: 1, Op: OpRead, MaxBytes: 4}, &Response{ID: 1, Data: []byte("abcde"), Size: 10}, "4 asked"},
		{"read over size", &Request{ID: 1, Op: OpRead}, &Response{ID: 1, Data: []byte("abc"), Size: 2}, "size 2"},
		{"negative size", &Request{ID: 1, Op: OpRead}, &Response{ID: 1, Size: -1}, "size -1"},
		{"honest ranged read", &Request{ID: 1, Op: OpRead, Offset: 8, MaxBytes: 4}, &Response{ID: 1, Data: []byte("ij"), Size: 10, Offset: 8}, ""},
		{"ranged read past the end", &Request{ID: 1, Op: OpRead, Offset: 8}, &Response{ID: 1, Data: []byte("ijk"), Size: 10, Offset: 8}, "at offset 8"},
		{"read at an offset past the size", &Request{ID: 1, Op: OpRead, Offset: 20}, &Response{ID: 1, Data: []byte("x"), Size: 10, Offset: 20}, "at offset 20"},
		{"negative offset", &Request{ID: 1, Op: OpRead}, &Response{ID: 1, Size: 10, Offset: -1}, "offset -1"},
		{"offset for a list", &Request{ID: 1, Op: OpList}, &Response{ID: 1, Offset: 3}, "file data"},
		{"honest list", &Request{ID: 1, Op: OpList}, &Response{ID: 1, Files: []FileInfo{{Path: "a/b.txt", Size: 3}, {Path: "a", Dir: true}}}, ""},
		{"absolute path", &Request{ID: 1, Op: OpList}, &Response{ID: 1, Files: []FileInfo{{Path: "/etc/passwd"}}}, "not inside"},
		{"dotdot path", &Request{ID: 1, Op: OpChanges}, &Response{ID: 1, Files: []FileInfo{{Path: "../x"}}}, "not inside"},
		{"unclean path", &Request{ID: 1, Op: OpList}, &Response{ID: 1, Files: []FileInfo{{Path: "a/../../x"}}}, "not inside"},
		{"NUL in a path", &Request{ID: 1, Op: OpList}, &Response{ID: 1, Files: []FileInfo{{Path: "a\x00b"}}}, "not inside"},
		{"negative entry size", &Request{ID: 1, Op: OpList}, &Response{ID: 1, Files: []FileInfo{{Path: "a", Size: -5}}}, "size -5"},
		{"honest special file", &Request{ID: 1, Op: OpList}, &Response{ID: 1, Files: []FileInfo{{Path: "p", Special: "fifo"}}}, ""},
		{"unknown special kind", &Request{ID: 1, Op: OpList}, &Response{ID: 1, Files: []FileInfo{{Path: "p", Special: strings.Repeat("k", 1000)}}}, "special kind"},
		{"too many entries", &Request{ID: 1, Op: OpList}, &Response{ID: 1, Files: make([]FileInfo, MaxListEntries+1)}, "entries"},
		{"honest limits", &Request{ID: 1, Op: OpLimits}, &Response{ID: 1, Limits: &Limits{OOMKills: 2, PidsRefused: -1}}, ""},
		{"limits refused", &Request{ID: 1, Op: OpLimits}, &Response{ID: 1, Error: `unknown operation "limits"`}, ""},
		{"limits without counts", &Request{ID: 1, Op: OpLimits}, &Response{ID: 1}, "limits response"},
		{"limits below -1", &Request{ID: 1, Op: OpLimits}, &Response{ID: 1, Limits: &Limits{OOMKills: -7}}, "limits response"},
		{"limits for an exec", execReq, &Response{ID: 1, Exec: &ExecResult{}, Limits: &Limits{}}, "limit counts"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			err := c.resp.Check(c.req)
			switch {
			case c.fault == "" && err != nil:
				t.Errorf("refused: %v", err)
			case c.fault != "" && err == nil:
				t.Errorf("accepted")
			case c.fault != "" && (!strings.Contains(err.Error(), c.fault) || !IsFault(err)):
				t.Errorf("fault %q, want it to mention %q", err, c.fault)
			}
		})
	}
}

// TestCheckCutsText checks that text model code controls through an
// honest agent is cut with a note rather than refused.
func TestCheckCutsText(t *testing.T) {
	big := strings.Repeat("é", MaxMessage)
	r := &Response{ID: 1, Error: big}
	if err := r.Check(&Request{ID: 1, Op: OpRead}); err != nil {
		t.Fatal(err)
	}
	if len(r.Error) > MaxMessage+100 || !strings.Contains(r.Error, "truncated") {
		t.Errorf("error of %d bytes", len(r.Error))
	}
	r = &Response{ID: 1, Exec: &ExecResult{Error: &ExecError{Name: "E", Value: big, Traceback: big}}}
	if err := r.Check(&Request{ID: 1, Op: OpPython}); err != nil {
		t.Fatal(err)
	}
	if len(r.Exec.Error.Traceback) > MaxMessage+100 || len(r.Exec.Notes) != 1 {
		t.Errorf("traceback of %d bytes, notes %q", len(r.Exec.Error.Traceback), r.Exec.Notes)
	}
}

// TestDecodeBounds checks the limits applied while decoding: rich output
// beyond MaxRich is dropped with a note, and lists too long to decode are
// refused before decoding.
func TestDecodeBounds(t *testing.T) {
	html := strings.Repeat("<td>x</td>", 1<<17) // 1.25 MiB
	var displays []string
	for range 10 {
		displays = append(displays, `{"text/html":"`+html+`","text/plain":"t","application/x-other":"o"}`)
	}
	r, err := decodeBody(t, `{"id":1,"exec":{"stdout":{"text":"","total":0},"stderr":{"text":"","total":0},"displays":[`+strings.Join(displays, ",")+`],"result":{"image/png":"!!"}}}`)
	if err != nil {
		t.Fatal(err)
	}
	kept := 0
	for _, d := range r.Exec.Displays {
		kept += len(d["text/html"])
		if _, ok := d["application/x-other"]; ok {
			t.Errorf("an unknown type was kept")
		}
		if d["text/plain"] != "t" {
			t.Errorf("plain text dropped before html: %v", d["text/plain"])
		}
	}
	if kept > MaxRich || kept == 0 {
		t.Errorf("kept %d bytes of html", kept)
	}
	if r.Exec.Result != nil {
		t.Errorf("an image that is not base64 was kept")
	}
	if n := strings.Join(r.Exec.Notes, "; "); !strings.Contains(n, "bytes of rich output") || !strings.Contains(n, "not valid base64") {
		t.Errorf("notes: %q", n)
	}
	for _, body := range []string{
		`{"id":1,"files":[` + strings.Repeat(`{},`, MaxItems) + `{}]}`,
		`{"id":1,"exec":{"result":{` + strings.Repeat(`"a":"",`, MaxItems) + `"b":""}}}`,
		strings.Repeat("[", maxDepth+1) + strings.Repeat("]", maxDepth+1),
	} {
		if _, err := decodeBody(t, body); !IsFault(err) {
			t.Errorf("%.40q…: %v", body, err)
		}
	}
	// Commas inside strings are not members.
	if _, err := decodeBody(t, `{"id":1,"error":"`+strings.Repeat(",", 2*MaxItems)+`"}`); err != nil {
		t.Errorf("commas in a string: %v", err)
	}
}
