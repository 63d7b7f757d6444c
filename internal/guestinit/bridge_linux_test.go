package guestinit

import (
	"bytes"
	"io"
	"net"
	"os"
	"testing"
)

type pipeRW struct {
	io.Reader
	io.Writer
}

func readN(t *testing.T, r io.Reader, n int) string {
	t.Helper()
	b := make([]byte, n)
	if _, err := io.ReadFull(r, b); err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// TestBridge: the agent's side (master) keeps one stream while the host's
// connection is replaced, as after a snapshot restore.
func TestBridge(t *testing.T) {
	toAgentR, toAgentW := io.Pipe()     // bridge writes what the host sent
	fromAgentR, fromAgentW := io.Pipe() // the agent writes, bridge reads
	conns := make(chan io.ReadWriteCloser)
	br := newBridge(pipeRW{fromAgentR, toAgentW})
	go br.serve(func() (io.ReadWriteCloser, error) {
		c, ok := <-conns
		if !ok {
			return nil, io.EOF
		}
		return c, nil
	})
	defer close(conns)

	go fromAgentW.Write([]byte("hello")) // before any host connects
	host1, bridge1 := net.Pipe()
	conns <- bridge1
	if got := readN(t, host1, 5); got != "hello" {
		t.Errorf("host 1 read %q", got)
	}
	go host1.Write([]byte("req1"))
	if got := readN(t, toAgentR, 4); got != "req1" {
		t.Errorf("agent read %q", got)
	}

	host1.Close() // the snapshot resets the connection
	go fromAgentW.Write([]byte("resp"))
	host2, bridge2 := net.Pipe()
	conns <- bridge2
	if got := readN(t, host2, 4); got != "resp" {
		t.Errorf("host 2 read %q", got)
	}
	go host2.Write([]byte("req2"))
	if got := readN(t, toAgentR, 4); got != "req2" {
		t.Errorf("agent read %q", got)
	}
}

// TestPtyRaw checks that the pty passes every byte value unchanged.
func TestPtyRaw(t *testing.T) {
	master, slave, err := ptyPair()
	if err != nil {
		t.Skipf("no pty here: %v", err)
	}
	defer master.Close()
	s, err := os.OpenFile(slave, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	var all []byte
	for i := range 256 {
		all = append(all, byte(i))
	}
	go master.Write(all)
	if got := readN(t, s, len(all)); !bytes.Equal([]byte(got), all) {
		t.Errorf("master→slave changed bytes: %q", got)
	}
	go s.Write(all)
	if got := readN(t, master, len(all)); !bytes.Equal([]byte(got), all) {
		t.Errorf("slave→master changed bytes: %q", got)
	}
}
