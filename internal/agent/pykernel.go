package agent

import (
	"bufio"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
	"sync"
	"syscall"
	"time"

	"kiln/internal/agentproto"
	"kiln/internal/kernel"
)

// maxResultLine bounds one answer of the driver; the driver itself drops
// representations over 8 MiB, so only a hostile cell writing to fd 4 gets
// near it.
const maxResultLine = 48 << 20

// pyKernel is one running python3 with the driver.
type pyKernel struct {
	proc  *os.Process
	state func() *os.ProcessState // nil while running, and for an adopted kernel
	// adoptedStatus is an adopted kernel's wait status, which the agent
	// collects as its parent (set before exited is closed).
	adoptedStatus *syscall.WaitStatus
	req           *os.File // our end of the driver's fd 3
	res           *bufio.Reader
	resFile       *os.File
	out           *demux
	errs          *demux
	// outW and errW are the agent's own write ends of the kernel's stdout
	// and stderr pipes: the agent marks where a cell's output starts and
	// ends with markers only it knows (see run).
	outW, errW *os.File
	exited     chan struct{}
	hello      driverHello

	mu      sync.Mutex
	running bool
}

type driverHello struct {
	Ready     bool     `json:"ready"`
	Python    string   `json:"python"`
	Preloaded []string `json:"preloaded"`
}

type driverResult struct {
	Cell        string                  `json:"cell"`
	Result      agentproto.MimeBundle   `json:"result"`
	Displays    []agentproto.MimeBundle `json:"displays"`
	Error       *agentproto.ExecError   `json:"error"`
	Interrupted bool                    `json:"interrupted"`
}

func startKernel(cfg *Config) (*pyKernel, error) {
	reqR, reqW, err := os.Pipe()
	if err != nil {
		return nil, err
	}
	resR, resW, err := os.Pipe()
	if err != nil {
		return nil, err
	}
	outR, outW, err := os.Pipe()
	if err != nil {
		return nil, err
	}
	errR, errW, err := os.Pipe()
	if err != nil {
		return nil, err
	}
	cmd := codeCommand(cfg, cfg.Python, "-u", "-c", kernel.Bootstrap)
	cmd.Dir = cfg.Workspace
	cmd.Env = append(childEnv(cfg), "KILN_DRIVER="+kernel.Driver, "KILN_PRELOAD="+strings.Join(cfg.Preload, ","))
	cmd.Stdin = nil
	cmd.Stdout = outW
	cmd.Stderr = errW
	cmd.ExtraFiles = []*os.File{reqR, resW}
	cmd.SysProcAttr = childAttr(cfg)
	err = kids.start(cmd)
	for _, f := range []*os.File{reqR, resW} {
		f.Close()
	}
	if err != nil {
		for _, f := range []*os.File{reqW, resR, outR, outW, errR, errW} {
			f.Close()
		}
		return nil, fmt.Errorf("starting python: %w", err)
	}
	k := &pyKernel{
		proc: cmd.Process, state: func() *os.ProcessState { return cmd.ProcessState },
		req: reqW, resFile: resR, res: bufio.NewReaderSize(resR, 1<<16),
		out: newDemux(), errs: newDemux(), exited: make(chan struct{}),
		outW: outW, errW: errW,
	}
	go k.pump(outR, k.out)
	go k.pump(errR, k.errs)
	go func() { cmd.Wait(); kids.done(cmd.Process.Pid); close(k.exited) }()
	if err := k.waitReady(); err != nil {
		return nil, err
	}
	return k, nil
}

// waitReady reads the driver's hello.
func (k *pyKernel) waitReady() error {
	line, err := k.readLine()
	if err == nil {
		err = json.Unmarshal(line, &k.hello)
	}
	if err != nil || !k.hello.Ready {
		k.kill()
		stderr := k.errs.flush().Stream().Text
		return fmt.Errorf("starting the python kernel: %v: %s", err, lastLines(stderr, 5))
	}
	// Anything printed while preloading is not a cell's output.
	k.out.flush()
	k.errs.flush()
	return nil
}

func (k *pyKernel) pump(r *os.File, d *demux) {
	defer r.Close()
	buf := make([]byte, 32<<10)
	for {
		n, err := r.Read(buf)
		if n > 0 {
			d.feed(buf[:n])
		}
		if err != nil {
			return
		}
	}
}

func (k *pyKernel) readLine() ([]byte, error) {
	var line []byte
	for {
		chunk, err := k.res.ReadSlice('\n')
		line = append(line, chunk...)
		if len(line) > maxResultLine {
			return nil, errors.New("kernel answer over the size cap")
		}
		if err == bufio.ErrBufferFull {
			continue
		}
		return line, err
	}
}

// run executes one cell. It returns an error only when the kernel died; the
// caller then starts a new one.
//
// Everything of the kernel process is the cell's to read and write: its
// memory, its pipes, fd 4 on which the driver answers. So the agent frames a
// cell itself, with what the cell cannot know. It writes a start marker into
// the kernel's stdout and stderr pipes before the request and drops what
// precedes it (output written between calls); it sends the request with a
// fresh cell id and takes only the answer that carries it; then it writes an
// end marker into both pipes. The driver wrote the cell's output before its
// answer, so the pipes hold all of it ahead of the end marker. The markers
// never leave the agent, whose memory code cannot read.
func (k *pyKernel) run(code string, maxOutput int, live *liveTail) (*agentproto.ExecResult, error) {
	k.mu.Lock()
	k.running = true
	k.mu.Unlock()
	defer func() {
		k.mu.Lock()
		k.running = false
		k.mu.Unlock()
	}()

	if maxOutput <= 0 {
		maxOutput = defaultMaxOutput // as newCapBuf does: arming the end marker must not start a new buffer
	}
	streams := []stream{{k.out, k.outW}, {k.errs, k.errW}}
	for _, s := range streams {
		s.start(maxOutput, live)
	}
	cell := hex.EncodeToString(randomBytes(16))
	req, _ := json.Marshal(map[string]string{"code": code, "cell": cell})
	if _, err := k.req.Write(append(req, '\n')); err != nil {
		return k.died()
	}
	var res driverResult
	for {
		line, err := k.readLine()
		if err != nil {
			return k.died()
		}
		res = driverResult{}
		if json.Unmarshal(line, &res) == nil && res.Cell == cell {
			break
		}
		// Not this cell's answer: a cell wrote to fd 4, or a stale answer
		// of a cell that forged its own end. Keep waiting.
	}
	for _, s := range streams {
		// The start marker is long since through, as a rule: what came
		// before it went with it, what came after is the cell's. If it
		// never came, nothing tells them apart: drop it all.
		if k.waitMarker(s.d) == nil {
			s.d.flush()
		}
		s.d.arm(newMarker(), maxOutput, nil)
	}
	// The end markers, written now, follow all the cell wrote before its
	// answer.
	for _, s := range streams {
		s.mark()
	}
	out := &agentproto.ExecResult{
		Stdout:    k.take(k.out),
		Stderr:    k.take(k.errs),
		Result:    res.Result,
		Displays:  res.Displays,
		Error:     res.Error,
		Interrupt: res.Interrupted,
	}
	out.Bound() // the driver keeps to the bounds; a cell writing to fd 4 need not
	return out, nil
}

// stream is one of the kernel's output pipes: its reader and the agent's
// write end.
type stream struct {
	d *demux
	w *os.File
}

// start arms a start marker and writes it: what the pipe held before it
// is dropped.
func (s stream) start(maxOutput int, live *liveTail) {
	select {
	case <-s.d.done: // a stale cell's buffer
	default:
	}
	s.d.arm(newMarker(), maxOutput, live)
	s.mark()
}

// mark writes the armed marker into the pipe.
func (s stream) mark() {
	s.d.mu.Lock()
	m := s.d.sentinel
	s.d.mu.Unlock()
	if m == nil || s.w == nil {
		return
	}
	s.w.SetWriteDeadline(time.Now().Add(sentinelWait))
	s.w.Write(m) // under PIPE_BUF: never interleaved with another write
}

// waitMarker waits for d's armed marker to come through.
func (k *pyKernel) waitMarker(d *demux) *capBuf {
	select {
	case b := <-d.done:
		return b
	case <-k.exited:
	case <-timeAfter(sentinelWait):
	}
	return nil
}

// take returns the cell's output: all up to the end marker, or, when that
// does not come, what there is.
func (k *pyKernel) take(d *demux) agentproto.Stream {
	if b := k.waitMarker(d); b != nil {
		return b.Stream()
	}
	return d.flush().Stream()
}

// newMarker is a marker no one but the agent knows.
func newMarker() []byte {
	return []byte("\x1ekiln-" + hex.EncodeToString(randomBytes(16)) + "\x1e")
}

func randomBytes(n int) []byte {
	b := make([]byte, n)
	rand.Read(b)
	return b
}

// died reports a kernel that exited mid-cell (killed by the OOM killer,
// os._exit, a segfault) as the cell's result.
func (k *pyKernel) died() (*agentproto.ExecResult, error) {
	select {
	case <-k.exited:
	case <-timeAfter(sentinelWait):
		k.kill()
		<-k.exited
	}
	stdout, stderr := k.out.flush().Stream(), k.errs.flush().Stream()
	how := "exited"
	sig := ""
	ws, known := k.adoptedStatus, k.adoptedStatus != nil
	if ps := k.processState(); ps != nil {
		if w, ok := ps.Sys().(syscall.WaitStatus); ok {
			ws, known = &w, true
		}
	}
	if known {
		if ws.Signaled() {
			sig = unixSignalName(ws.Signal())
			how = "was killed by " + sig
			if ws.Signal() == syscall.SIGKILL {
				how += " (most often the memory limit)"
			}
		} else {
			how = fmt.Sprintf("exited with status %d", ws.ExitStatus())
		}
	}
	return &agentproto.ExecResult{
		Stdout: stdout,
		Stderr: stderr,
		Error: &agentproto.ExecError{
			Name:      "KernelDied",
			Value:     "the Python process " + how + "; the kernel was restarted and its variables are gone",
			Traceback: "",
		},
		Signal: sig,
	}, errKernelDied
}

var errKernelDied = errors.New("kernel died")

func (k *pyKernel) interrupt() {
	k.mu.Lock()
	running := k.running
	k.mu.Unlock()
	if running && k.proc != nil {
		k.proc.Signal(syscall.SIGINT)
	}
}

func (k *pyKernel) processState() *os.ProcessState {
	if k.state == nil {
		return nil
	}
	return k.state()
}

func (k *pyKernel) kill() {
	if k.proc != nil {
		k.proc.Kill()
	}
	k.req.Close()
	k.resFile.Close()
	if k.outW != nil {
		k.outW.Close()
	}
	if k.errW != nil {
		k.errW.Close()
	}
}

func lastLines(s string, n int) string {
	lines := strings.Split(strings.TrimSpace(s), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

var _ io.Writer = (*capBuf)(nil)
