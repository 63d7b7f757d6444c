package bench

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"time"

	"kiln/internal/sandbox"
)

// The same-run baselines kiln's per-call figures are judged against,
// beside the bare python3 spawn: what a user would pick instead
// (bubblewrap, a spawn in fresh namespaces), and the floor of kiln's own
// design (a fork of a python that imported the same preloads).

// bwrapArgs make a bubblewrap box as a user would for the same job: every
// namespace it can unshare, the host's root read-only, fresh /dev, /proc
// and /tmp.
func bwrapArgs(python, code string) []string {
	return []string{"--unshare-all", "--die-with-parent", "--ro-bind", "/", "/", "--dev", "/dev",
		"--proc", "/proc", "--tmpfs", "/tmp", python, "-c", code}
}

// bwrapPath is bubblewrap's path, or a line that says why it is not
// measured.
func (r *runner) bwrapPath() (string, string) {
	p, err := exec.LookPath(r.opts.Bwrap)
	if err != nil {
		return "", fmt.Sprintf("skipped: no %s in $PATH (the Debian package bubblewrap)", r.opts.Bwrap)
	}
	return p, ""
}

// bwrap measures a bubblewrap spawn of python3 -c 'print(2+2)': latency
// and CPU per spawn.
func (r *runner) bwrap(ctx context.Context) error {
	const key, name = "spawn-bwrap", "bwrap python3 -c 'print(2+2)' spawn"
	bw, why := r.bwrapPath()
	if bw == "" {
		r.add(Measurement{Key: key, Name: name, Err: why})
		return nil
	}
	r.progress("measuring %s", name)
	var samples []time.Duration
	w := r.cpuStart(nil)
	for range r.opts.Iterations {
		start := time.Now()
		out, err := exec.CommandContext(ctx, bw, bwrapArgs(r.opts.Python, printCode)...).CombinedOutput()
		d := time.Since(start)
		if err != nil || string(out) != "4\n" {
			return fmt.Errorf("running %s: %v: %s", bw, err, out)
		}
		samples = append(samples, d)
	}
	span := w.stop()
	r.latency(key, name, samples, strings.Join(bwrapArgs(r.opts.Python, "…")[:11], " "))
	r.cpuRow("cpu-bwrap", "CPU per bwrap spawn", span, len(samples), "the bench's cgroup over the bwrap series / spawns")
	return nil
}

// bwrapThroughput runs n concurrent bubblewrap spawns for Duration, the
// baseline of kiln's throughput at n clients.
func (r *runner) bwrapThroughput(ctx context.Context, n int) {
	key := fmt.Sprintf("throughput-bwrap-%d", n)
	name := fmt.Sprintf("bwrap spawn throughput, %d client%s", n, plural(n))
	bw, why := r.bwrapPath()
	if bw == "" {
		r.add(Measurement{Key: key, Name: name, Err: why})
		return
	}
	r.progress("measuring bwrap throughput with %d concurrent clients for %s", n, r.opts.Duration)
	w := r.cpuStart(nil)
	l := closedLoop(ctx, n, r.opts.Duration, func() error {
		out, err := exec.CommandContext(ctx, bw, bwrapArgs(r.opts.Python, printCode)...).CombinedOutput()
		if err != nil || string(out) != "4\n" {
			return fmt.Errorf("%v: %s", err, out)
		}
		return nil
	})
	span := w.stop()
	samples := l.samples
	m := l.measurement(key, name, "spawns")
	r.add(m)
	r.cpuRow(fmt.Sprintf("cpu-bwrap-%d", n), fmt.Sprintf("CPU per bwrap spawn, %d client%s", n, plural(n)), span, len(samples),
		"the bench's cgroup over the run / spawns")
}

// forkServer is the far end of the fork baseline: a python that imported
// the preloads as kiln's template does (matplotlib with pyplot, on Agg)
// and forks a child per byte on stdin. "f": the child prints 2+2 and
// exits, the parent reaps it and writes ".". "m": the child prints 2+2
// and its pid and waits for a byte before it exits (its memory is read
// meanwhile).
const forkServer = `import gc, os, sys
for m in sys.argv[1].split(","):
    if not m:
        continue
    try:
        __import__(m)
        if m == "matplotlib":
            import matplotlib.pyplot
    except Exception:
        pass
gc.collect()
gc.freeze()
r = sys.stdin.buffer
os.write(1, b"ready\n")
while True:
    op = r.read(1)
    if not op:
        break
    pid = os.fork()
    if pid == 0:
        print(2+2)
        if op == b"m":
            print(os.getpid())
        sys.stdout.flush()
        if op == b"m":
            os.read(0, 1)
        os._exit(0)
    os.waitpid(pid, 0)
    os.write(1, b".\n")
`

// serverPreload is the --preload of the servers under test, or kiln's
// default.
func serverPreload(args []string) string {
	preload := strings.Join(sandbox.DefaultPreload, ",")
	for i, a := range args {
		switch {
		case (a == "--preload" || a == "-preload") && i+1 < len(args):
			preload = args[i+1]
		case strings.HasPrefix(a, "--preload="), strings.HasPrefix(a, "-preload="):
			preload = a[strings.Index(a, "=")+1:]
		}
	}
	return preload
}

// fork measures a fork of a python with the servers' preloads that runs
// print(2+2) and exits: the floor of a box made by fork, without any of
// its isolation. Then the private memory of one such child, idle.
func (r *runner) fork(ctx context.Context) error {
	preload := serverPreload(r.opts.ServerArgs)
	const name = "fork of a python with the preloads, print(2+2)"
	r.progress("measuring %s", name)
	h, err := startHelper(ctx, r.opts.Python, nil, "-c", forkServer, preload)
	if err != nil {
		return err
	}
	defer h.close()
	stdin, rd := h.stdin, h.out
	expect := func(want string) (string, error) {
		got, err := rd.ReadString('\n')
		if err != nil {
			return "", fmt.Errorf("reading from the fork server: %w", err)
		}
		if want != "" && got != want {
			return "", fmt.Errorf("the fork server said %q, want %q", strings.TrimSpace(got), strings.TrimSpace(want))
		}
		return got, nil
	}
	if _, err := expect("ready\n"); err != nil {
		return err
	}
	one := func() (time.Duration, error) {
		start := time.Now()
		if _, err := io.WriteString(stdin, "f"); err != nil {
			return 0, err
		}
		if _, err := expect("4\n"); err != nil {
			return 0, err
		}
		if _, err := expect(".\n"); err != nil {
			return 0, err
		}
		return time.Since(start), nil
	}
	for range 3 { // the first forks fault in what the imports left
		if _, err := one(); err != nil {
			return err
		}
	}
	var samples []time.Duration
	w := r.cpuStart(nil)
	for range r.opts.Iterations {
		d, err := one()
		if err != nil {
			return err
		}
		samples = append(samples, d)
	}
	span := w.stop()
	r.latency("fork", name, samples, fmt.Sprintf("preloads %q; os.fork, the child prints and exits, the parent reaps it; no isolation", preload))
	r.cpuRow("cpu-fork", "CPU per fork of the same python", span, len(samples), "the bench's cgroup over the fork series / forks")

	if _, err := io.WriteString(stdin, "m"); err != nil {
		return err
	}
	if _, err := expect("4\n"); err != nil {
		return err
	}
	line, err := expect("")
	if err != nil {
		return err
	}
	pid, err := strconv.Atoi(strings.TrimSpace(line))
	if err != nil {
		return fmt.Errorf("the fork server's child said %q, not its pid", line)
	}
	time.Sleep(200 * time.Millisecond)
	mem, err := readMemory(pid)
	io.WriteString(stdin, "x")
	if _, err2 := expect(".\n"); err == nil {
		err = err2
	}
	if err != nil {
		return fmt.Errorf("reading the forked child's memory: %w", err)
	}
	v := float64(mem.Private) / 1024
	r.add(Measurement{Key: "private-fork", Name: "private memory of an idle forked child", Unit: "MiB", N: 1, P50: v, P99: v,
		Note: fmt.Sprintf("Private_Clean+Private_Dirty of a fork that ran print(2+2); PSS %.1f MiB beside its parent", float64(mem.Pss)/1024)})
	return nil
}

// native measures the backend's own runtime spawned for one print(2+2)
// without kiln (Traits.Native): latency and CPU per spawn, a tenth of the
// iterations (at least 3), since such a spawn takes seconds.
func (r *runner) native(ctx context.Context) error {
	if r.opts.Traits.Native == nil {
		return nil
	}
	key, name := "spawn-native", r.opts.Backend+"'s own runtime, print(2+2) spawn"
	argv, err := r.opts.Traits.Native(r.opts.Python)
	if err != nil {
		r.add(Measurement{Key: key, Name: name, Err: "skipped: " + err.Error()})
		return nil
	}
	n := max(r.opts.Iterations/10, 3)
	r.progress("measuring %s (%d spawns)", name, n)
	var samples []time.Duration
	w := r.cpuStart(nil)
	for range n {
		start := time.Now()
		out, err := exec.CommandContext(ctx, argv[0], argv[1:]...).CombinedOutput()
		d := time.Since(start)
		if err != nil || !strings.HasSuffix(string(out), "4\n") {
			return fmt.Errorf("running %s: %v: %s", strings.Join(argv, " "), err, out)
		}
		samples = append(samples, d)
	}
	span := w.stop()
	r.latency(key, name, samples, strings.Join(argv, " "))
	r.cpuRow("cpu-native", "CPU per "+r.opts.Backend+" runtime spawn", span, len(samples), "the bench's cgroup over the series / spawns")
	return nil
}

// helper is a python the bench drives over its stdin and stdout (the
// fork and Jupyter baselines).
type helper struct {
	cmd   *exec.Cmd
	stdin io.WriteCloser
	out   *bufio.Reader
}

// startHelper starts python with args, matplotlib on Agg, its stderr to
// stderr (nil: dropped).
func startHelper(ctx context.Context, python string, stderr io.Writer, args ...string) (*helper, error) {
	cmd := exec.CommandContext(ctx, python, args...)
	cmd.Env = append(os.Environ(), "MPLBACKEND=Agg")
	cmd.Stderr = stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return nil, err
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("starting %s: %w", python, err)
	}
	return &helper{cmd: cmd, stdin: stdin, out: bufio.NewReader(stdout)}, nil
}

// close ends the helper's input and waits for it.
func (h *helper) close() {
	h.stdin.Close()
	h.cmd.Wait()
}
