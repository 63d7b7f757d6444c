package sandbox

import (
	"context"
	"errors"
	"net"
	"os/exec"
	"slices"
	"strings"
	"testing"

	"kiln/internal/agentproto"
)

// restoredAgent plays the agent of a restored box: it does not say hello
// (it did before the snapshot) and records the code it runs.
func restoredAgent(guest net.Conn, ran chan<- string) {
	defer guest.Close()
	for {
		var req agentproto.Request
		if agentproto.ReadFrame(guest, &req) != nil {
			return
		}
		ran <- req.Code
		agentproto.WriteFrame(guest, &agentproto.Response{ID: req.ID, Exec: &agentproto.ExecResult{}})
	}
}

// RestoreConn replays the template's hello, reseeds the guest first and
// then the agent's Python, before it hands the box out.
func TestRestoreConn(t *testing.T) {
	host, guest := net.Pipe()
	ran := make(chan string, 10)
	go restoredAgent(guest, ran)
	var steps []string
	hello := agentproto.Hello{Version: agentproto.Version, Python: "3.test"}
	c, err := RestoreConn(context.Background(), "r", host, hello, nil, &RestoreOptions{
		ReseedGuest: func(context.Context) error { steps = append(steps, "guest"); return nil },
	})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if h := c.Hello(); h.Python != "3.test" {
		t.Errorf("hello not replayed: %+v", h)
	}
	steps = append(steps, <-ran)
	if want := []string{"guest", ReseedCell}; !slices.Equal(steps, want) {
		t.Errorf("steps = %q, want %q", steps, want)
	}
}

// A box whose guest cannot be reseeded is destroyed, not handed out.
func TestRestoreConnReseedFails(t *testing.T) {
	host, guest := net.Pipe()
	defer guest.Close()
	destroyed := false
	boom := errors.New("boom")
	_, err := RestoreConn(context.Background(), "r", host, agentproto.Hello{Version: agentproto.Version}, func() error { destroyed = true; return nil }, &RestoreOptions{
		ReseedGuest: func(context.Context) error { return boom },
	})
	if !errors.Is(err, boom) || !destroyed {
		t.Errorf("err = %v, destroyed = %v", err, destroyed)
	}
}

// TestReseedCode runs the one reseed list in a python that has drawn from
// random and named a temporary file: random draws anew, and tempfile
// starts a new name sequence.
func TestReseedCode(t *testing.T) {
	python, err := exec.LookPath("python3")
	if err != nil {
		t.Skip("no python3 on this host")
	}
	script := `import random, tempfile
random.seed(7)
a = random.random()
tempfile._get_candidate_names()
random.seed(7)
` + ReseedCell + `
assert random.random() != a, "random was not reseeded"
assert tempfile._name_sequence is None, "tempfile keeps its names"
assert "m" not in dir(), "the cell left a name behind"
print("ok")
`
	out, err := exec.Command(python, "-c", script).CombinedOutput()
	if err != nil || strings.TrimSpace(string(out)) != "ok" {
		t.Fatalf("python3: %v: %s", err, out)
	}
}
