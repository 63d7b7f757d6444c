package bench

import (
	"context"
	"fmt"
	"io"
	"os/exec"
	"strconv"
	"strings"
	"time"
)

// jupyterClient is the far end of the Jupyter baseline: the host's
// jupyter_client starts an ipykernel, as a notebook server would, makes
// the kernel import the servers' preloads, prints the kernel's pid, then
// for every byte on stdin executes print(2+2) and waits for the kernel to
// go idle (its stream output collected, as kiln collects a call's), and
// writes what the cell printed. A Jupyter session call crosses the same
// number of processes as kiln's: the client, the notebook side (this
// python) and the kernel.
const jupyterClient = `import sys
from jupyter_client.manager import start_new_kernel
km, kc = start_new_kernel(kernel_name="python3")
try:
    mods = [m for m in sys.argv[1].split(",") if m]
    code = "".join("try:\n    import %s\nexcept Exception:\n    pass\n" % m for m in mods)
    if "matplotlib" in mods:
        code += "try:\n    import matplotlib.pyplot\nexcept Exception:\n    pass\n"
    kc.execute_interactive(code, timeout=300, output_hook=lambda msg: None)
    pid = getattr(km.provisioner, "pid", None) or km.provisioner.process.pid
    sys.stdout.write("ready %d\n" % pid)
    sys.stdout.flush()
    r = sys.stdin.buffer
    while r.read(1):
        out = []
        def hook(msg):
            if msg["msg_type"] == "stream":
                out.append(msg["content"]["text"])
        reply = kc.execute_interactive("print(2+2)", timeout=60, output_hook=hook)
        if reply["content"]["status"] != "ok":
            out = ["error %s\n" % reply["content"].get("ename")]
        sys.stdout.write("".join(out) or "nothing\n")
        sys.stdout.flush()
finally:
    kc.stop_channels()
    km.shutdown_kernel(now=True)
`

// jupyterMissing says why the Jupyter baseline cannot run with python, or
// "" if it can.
func jupyterMissing(ctx context.Context, python string) string {
	out, err := exec.CommandContext(ctx, python, "-c", "import jupyter_client, ipykernel").CombinedOutput()
	if err != nil {
		return fmt.Sprintf("skipped: %s cannot import jupyter_client and ipykernel (the Debian packages python3-jupyter-client and python3-ipykernel): %s",
			python, lastLine(string(out)))
	}
	return ""
}

func lastLine(s string) string {
	s = strings.TrimSpace(s)
	if i := strings.LastIndexByte(s, '\n'); i >= 0 {
		s = s[i+1:]
	}
	return s
}

// jupyter measures a Jupyter kernel's cell round trip and its memory,
// idle, with the same preloads imported: the baseline of a session call
// and of a session box's memory, what a user would run instead of a kiln
// session.
func (r *runner) jupyter(ctx context.Context) error {
	const key, name = "jupyter-call", "Jupyter kernel cell print(2+2)"
	if why := jupyterMissing(ctx, r.opts.Python); why != "" {
		r.add(Measurement{Key: key, Name: name, Err: why})
		return nil
	}
	preload := serverPreload(r.opts.ServerArgs)
	r.progress("measuring %s", name)
	var stderr strings.Builder
	h, err := startHelper(ctx, r.opts.Python, &limitedWriter{w: &stderr, n: 4096}, "-c", jupyterClient, preload)
	if err != nil {
		return err
	}
	defer h.close()
	stdin, rd := h.stdin, h.out
	line := func() (string, error) {
		got, err := rd.ReadString('\n')
		if err != nil {
			return "", fmt.Errorf("reading from the Jupyter client: %v: %s", err, lastLine(stderr.String()))
		}
		return strings.TrimSuffix(got, "\n"), nil
	}
	ready, err := line()
	if err != nil {
		return err
	}
	pid, err := strconv.Atoi(strings.TrimPrefix(ready, "ready "))
	if err != nil || pid <= 0 {
		return fmt.Errorf("the Jupyter client said %q, want its kernel's pid", ready)
	}
	one := func() (time.Duration, error) {
		start := time.Now()
		if _, err := io.WriteString(stdin, "x"); err != nil {
			return 0, err
		}
		got, err := line()
		d := time.Since(start)
		if err != nil {
			return 0, err
		}
		if got != "4" {
			return 0, fmt.Errorf("the Jupyter kernel printed %q, want 4", got)
		}
		return d, nil
	}
	for range 3 {
		if _, err := one(); err != nil {
			return err
		}
	}
	var samples []time.Duration
	for range r.opts.Iterations {
		d, err := one()
		if err != nil {
			return err
		}
		samples = append(samples, d)
	}
	r.latency(key, name, samples, fmt.Sprintf("jupyter_client's execute_interactive to an ipykernel that imported %q, until the kernel is idle; the host's python, no container", preload))
	if m, err := readMemory(pid); err == nil {
		for _, row := range []struct {
			key, name string
			kib       int64
		}{
			{"pss-jupyter", "PSS of an idle Jupyter kernel", m.Pss},
			{"private-jupyter", "private memory of an idle Jupyter kernel", m.Private},
		} {
			v := float64(row.kib) / 1024
			r.add(Measurement{Key: row.key, Name: row.name, Unit: "MiB", N: 1, P50: v, P99: v,
				Note: fmt.Sprintf("pid %d after the preloads and %d cells; one kernel, so its PSS shares the host's libraries with no other kernel", pid, len(samples)+3)})
		}
	}
	return nil
}

// limitedWriter keeps the first n bytes written to it and drops the rest.
type limitedWriter struct {
	w io.Writer
	n int
}

func (l *limitedWriter) Write(p []byte) (int, error) {
	if l.n > 0 {
		k := min(len(p), l.n)
		l.w.Write(p[:k])
		l.n -= k
	}
	return len(p), nil
}
