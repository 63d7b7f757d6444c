package egress

import (
	"bufio"
	"bytes"
	"crypto/tls"
	"errors"
	"net"
	"strings"
	"testing"
)

// clientHello returns the bytes a crypto/tls client sends first.
func clientHello(t testing.TB, serverName string) []byte {
	t.Helper()
	c1, c2 := net.Pipe()
	done := make(chan []byte)
	go func() {
		buf := make([]byte, 64<<10)
		var got []byte
		for {
			n, err := c2.Read(buf)
			got = append(got, buf[:n]...)
			if _, need, perr := parseClientHello(got); err != nil || need == 0 || perr != nil {
				break
			}
		}
		c2.Close()
		done <- got
	}()
	tc := tls.Client(c1, &tls.Config{ServerName: serverName, InsecureSkipVerify: serverName == ""})
	tc.Handshake() // fails when c2 closes
	return <-done
}

func TestParseClientHello(t *testing.T) {
	b := clientHello(t, "files.pythonhosted.org")
	name, need, err := parseClientHello(b)
	if err != nil || need != 0 || name != "files.pythonhosted.org" {
		t.Fatalf("parseClientHello = %q, %d, %v", name, need, err)
	}
	for i := range len(b) {
		_, need, err := parseClientHello(b[:i])
		if err != nil || need <= i {
			t.Fatalf("prefix of %d bytes: need %d, err %v", i, need, err)
		}
	}
	// The same hello split over several records still parses.
	body := b[5:]
	var split []byte
	for chunk := range slicesChunk(body, 100) {
		split = append(split, 22, 3, 1, byte(len(chunk)>>8), byte(len(chunk)))
		split = append(split, chunk...)
	}
	if name, _, err := parseClientHello(split); err != nil || name != "files.pythonhosted.org" {
		t.Errorf("fragmented: %q, %v", name, err)
	}

	noSNI := clientHello(t, "")
	if _, _, err := parseClientHello(noSNI); !errors.Is(err, errNoSNI) {
		t.Errorf("hello without SNI: err %v", err)
	}
	for _, bad := range [][]byte{
		[]byte("GET / HTTP/1.1\r\n"),
		{22, 3, 1, 0, 0},
		{23, 3, 3, 0, 5, 1, 2, 3, 4, 5},
		{22, 3, 3, 0, 4, 2, 0, 0, 0}, // ServerHello
		{22, 3, 3, 0, 4, 1, 0, 0, 0}, // empty ClientHello
	} {
		if _, need, err := parseClientHello(bad); err == nil && need == 0 {
			t.Errorf("%q parsed", bad)
		}
	}
}

func slicesChunk(b []byte, n int) func(func([]byte) bool) {
	return func(yield func([]byte) bool) {
		for len(b) > 0 {
			k := min(n, len(b))
			if !yield(b[:k]) {
				return
			}
			b = b[k:]
		}
	}
}

func TestSniffTLSKeepsBytes(t *testing.T) {
	b := clientHello(t, "web.test")
	br := bufio.NewReaderSize(bytes.NewReader(append(b, "rest"...)), sniffBuffer)
	name, err := sniffTLS(br)
	if err != nil || name != "web.test" {
		t.Fatalf("sniffTLS = %q, %v", name, err)
	}
	var all bytes.Buffer
	all.ReadFrom(br)
	if !bytes.Equal(all.Bytes(), append(b, "rest"...)) {
		t.Error("sniffing consumed bytes")
	}
}

func FuzzParseClientHello(f *testing.F) {
	f.Add(clientHello(f, "web.test"))
	f.Add(clientHello(f, ""))
	f.Add([]byte{22, 3, 1, 0, 4, 1, 0, 0, 0})
	f.Fuzz(func(t *testing.T, b []byte) {
		name, need, err := parseClientHello(b)
		if need != 0 && (need <= len(b) || err != nil || name != "") {
			t.Fatalf("need %d with %d bytes, name %q, err %v", need, len(b), name, err)
		}
		if need == 0 && err == nil && (name == "" || strings.ContainsAny(name, " \r\n\x00")) {
			t.Fatalf("bad name %q", name)
		}
	})
}
