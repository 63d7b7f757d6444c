package bench

import (
	"context"
	"fmt"
	"io"
	"strings"
	"time"
)

// pipeLoop is the far end of the bare-pipe baseline: a python3 that reads
// a line on stdin and writes it back, flushed, until stdin closes.
const pipeLoop = `import sys
r, w = sys.stdin.buffer, sys.stdout.buffer
while True:
    line = r.readline()
    if not line:
        break
    w.write(line)
    w.flush()
`

// pipeLine is about the size of a session call's request.
var pipeLine = `{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"run_python","arguments":{"code":"print(2+2)","session":"bench"}}}` + "\n"

// pipe measures a round trip over a pipe to a python loop: the floor of a
// session call, which crosses two more processes (kiln, the box's agent)
// and runs the code.
func (r *runner) pipe(ctx context.Context) error {
	r.progress("measuring bare pipe round trips to a python3 loop")
	samples, err := pipeRoundTrips(ctx, r.opts.Python, r.opts.Iterations*4)
	if err != nil {
		return err
	}
	r.latency("pipe", "bare pipe round trip to a python3 loop", samples,
		"a line written to a python3 readline loop and read back; the host's python, no container")
	return nil
}

func pipeRoundTrips(ctx context.Context, python string, n int) ([]time.Duration, error) {
	h, err := startHelper(ctx, python, nil, "-u", "-c", pipeLoop)
	if err != nil {
		return nil, err
	}
	defer h.close()
	stdin, rd := h.stdin, h.out
	warm := 10
	var samples []time.Duration
	for i := range n + warm {
		start := time.Now()
		if _, err := io.WriteString(stdin, pipeLine); err != nil {
			return nil, fmt.Errorf("writing to the python loop: %w", err)
		}
		got, err := rd.ReadString('\n')
		d := time.Since(start)
		if err != nil {
			return nil, fmt.Errorf("reading from the python loop: %w", err)
		}
		if got != pipeLine {
			return nil, fmt.Errorf("the python loop answered %q", strings.TrimSpace(got))
		}
		if i >= warm {
			samples = append(samples, d)
		}
	}
	return samples, nil
}
