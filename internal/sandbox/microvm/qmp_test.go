package microvm

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"net"
	"os"
	"syscall"
	"testing"

	"github.com/google/go-cmp/cmp"
)

// fakeQEMU answers QMP on conn: it records each command, replies from
// answers (by command name) and sends an event before every reply.
func fakeQEMU(t *testing.T, conn *net.UnixConn, answers map[string]string, got chan<- string, fds chan<- int) {
	t.Helper()
	go func() {
		defer conn.Close()
		conn.Write([]byte(`{"QMP": {"version": {"qemu": {"major": 7}}, "capabilities": []}}` + "\n"))
		for {
			buf := make([]byte, 4096)
			oob := make([]byte, 64)
			n, oobn, _, _, err := conn.ReadMsgUnix(buf, oob)
			if err != nil {
				return
			}
			if oobn > 0 {
				msgs, _ := syscall.ParseSocketControlMessage(oob[:oobn])
				for _, m := range msgs {
					if rights, err := syscall.ParseUnixRights(&m); err == nil {
						for _, fd := range rights {
							fds <- fd
						}
					}
				}
			}
			var req struct {
				Execute   string          `json:"execute"`
				Arguments json.RawMessage `json:"arguments"`
			}
			if err := json.Unmarshal(buf[:n], &req); err != nil {
				t.Errorf("fake qemu: bad command %q: %v", buf[:n], err)
				return
			}
			got <- req.Execute + " " + string(req.Arguments)
			conn.Write([]byte(`{"event": "TICK", "data": {}}` + "\n"))
			a, ok := answers[req.Execute]
			if !ok {
				a = `{"return": {}}`
			}
			conn.Write([]byte(a + "\n"))
		}
	}()
}

func qmpPair(t *testing.T) (client, server *net.UnixConn) {
	fds, err := syscall.Socketpair(syscall.AF_UNIX, syscall.SOCK_STREAM, 0)
	if err != nil {
		t.Fatal(err)
	}
	conv := func(fd int) *net.UnixConn {
		f := os.NewFile(uintptr(fd), "s")
		defer f.Close()
		c, err := net.FileConn(f)
		if err != nil {
			t.Fatal(err)
		}
		return c.(*net.UnixConn)
	}
	return conv(fds[0]), conv(fds[1])
}

func TestQMP(t *testing.T) {
	client, server := qmpPair(t)
	got := make(chan string, 100)
	fds := make(chan int, 10)
	fakeQEMU(t, server, map[string]string{
		"query-status":  `{"return": {"running": true, "status": "running"}}`,
		"query-migrate": `{"return": {"status": "failed", "error-desc": "boom"}}`,
		"cont":          `{"error": {"class": "GenericError", "desc": "nope"}}`,
	}, got, fds)
	ctx := context.Background()
	q, err := dialQMP(ctx, client)
	if err != nil {
		t.Fatal(err)
	}
	defer q.Close()
	if err := q.setMigrationCaps(ctx, "x-ignore-shared"); err != nil {
		t.Fatal(err)
	}
	st, err := q.queryStatus(ctx)
	if err != nil || !st.Running {
		t.Errorf("queryStatus = %+v, %v", st, err)
	}
	mi, err := q.queryMigrate(ctx)
	if err != nil || mi != (migrationInfo{"failed", "boom"}) {
		t.Errorf("queryMigrate = %+v, %v", mi, err)
	}
	var qe *QMPError
	if err := q.cont(ctx); !errors.As(err, &qe) || qe.Desc != "nope" || qe.Command != "cont" {
		t.Errorf("cont error = %v", err)
	}
	f, err := os.Open(os.DevNull)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := q.getfd(ctx, "state", f); err != nil {
		t.Fatal(err)
	}
	if fd := <-fds; fd < 0 {
		t.Error("no descriptor passed")
	} else {
		syscall.Close(fd)
	}
	if err := q.migrate(ctx, "fd:state"); err != nil {
		t.Fatal(err)
	}
	if n := len(q.Events()); n != 7 {
		t.Errorf("%d events kept, want 7", n)
	}
	var cmds []string
	for range 7 {
		cmds = append(cmds, <-got)
	}
	want := []string{
		"qmp_capabilities ",
		`migrate-set-capabilities {"capabilities":[{"capability":"x-ignore-shared","state":true}]}`,
		"query-status ", "query-migrate ", "cont ",
		`getfd {"fdname":"state"}`,
		`migrate {"uri":"fd:state"}`,
	}
	if d := cmp.Diff(want, cmds); d != "" {
		t.Errorf("commands (-want +got):\n%s", d)
	}
}

// TestQMPContext checks that an unanswered command gives up with its ctx.
func TestQMPContext(t *testing.T) {
	client, server := qmpPair(t)
	defer server.Close()
	go server.Write([]byte(`{"QMP": {}}` + "\n"))
	ctx, cancel := context.WithCancel(context.Background())
	go func() {
		// Read the capabilities command, answer it, then go silent.
		r := bufio.NewReader(server)
		r.ReadString('\n')
		server.Write([]byte(`{"return": {}}` + "\n"))
		r.ReadString('\n')
		cancel()
	}()
	q, err := dialQMP(context.Background(), client)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := q.queryStatus(ctx); !errors.Is(err, context.Canceled) {
		t.Errorf("err = %v, want context.Canceled", err)
	}
}

func TestQMPNotQMP(t *testing.T) {
	client, server := qmpPair(t)
	go func() {
		server.Write([]byte(`{"hello": 1}` + "\n"))
		server.Close()
	}()
	if _, err := dialQMP(context.Background(), client); err == nil {
		t.Error("accepted a non-QMP greeting")
	}
}
