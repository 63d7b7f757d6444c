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
	"os/exec"
	"strings"
	"sync"
	"syscall"

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
	// adoptedStatus is an adopted kernel's wait status, reported by the
	// box's PID 1 (set before exited is closed).
	adoptedStatus *syscall.WaitStatus
	req           *os.File // our end of the driver's fd 3
	res           *bufio.Reader
	resFile       *os.File
	out           *demux
	errs          *demux
	exited        chan struct{}
	hello         driverHello

	mu      sync.Mutex
	running bool
}

type driverHello struct {
	Ready     bool     `json:"ready"`
	Python    string   `json:"python"`
	Preloaded []string `json:"preloaded"`
}

type driverResult struct {
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
	cmd := exec.Command(cfg.Python, "-u", "-c", kernel.Bootstrap)
	cmd.Dir = cfg.Workspace
	cmd.Env = append(childEnv(cfg), "KILN_DRIVER="+kernel.Driver, "KILN_PRELOAD="+strings.Join(cfg.Preload, ","))
	cmd.Stdin = nil
	cmd.Stdout = outW
	cmd.Stderr = errW
	cmd.ExtraFiles = []*os.File{reqR, resW}
	cmd.SysProcAttr = childAttr(cfg)
	err = cmd.Start()
	for _, f := range []*os.File{reqR, resW, outW, errW} {
		f.Close()
	}
	if err != nil {
		reqW.Close()
		resR.Close()
		outR.Close()
		errR.Close()
		return nil, fmt.Errorf("starting python: %w", err)
	}
	k := &pyKernel{
		proc: cmd.Process, state: func() *os.ProcessState { return cmd.ProcessState },
		req: reqW, resFile: resR, res: bufio.NewReaderSize(resR, 1<<16),
		out: newDemux(), errs: newDemux(), exited: make(chan struct{}),
	}
	go k.pump(outR, k.out)
	go k.pump(errR, k.errs)
	go func() { cmd.Wait(); close(k.exited) }()
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
func (k *pyKernel) run(code string, maxOutput int) (*agentproto.ExecResult, error) {
	k.mu.Lock()
	k.running = true
	k.mu.Unlock()
	defer func() {
		k.mu.Lock()
		k.running = false
		k.mu.Unlock()
	}()

	var nonce [16]byte
	rand.Read(nonce[:])
	sentinel := []byte("\x1ekiln-end-" + hex.EncodeToString(nonce[:]) + "\x1e")
	k.out.arm(sentinel, maxOutput)
	k.errs.arm(sentinel, maxOutput)

	req, _ := json.Marshal(map[string]string{"code": code, "sentinel": string(sentinel)})
	if _, err := k.req.Write(append(req, '\n')); err != nil {
		return k.died()
	}
	var res driverResult
	for {
		line, err := k.readLine()
		if err != nil {
			return k.died()
		}
		if json.Unmarshal(line, &res) == nil {
			break
		}
		// Not the driver's answer: a cell wrote to fd 4. Keep waiting.
	}
	stdout, stderr := k.collect()
	return &agentproto.ExecResult{
		Stdout:    stdout,
		Stderr:    stderr,
		Result:    res.Result,
		Displays:  res.Displays,
		Error:     res.Error,
		Interrupt: res.Interrupted,
	}, nil
}

// collect waits for both sentinels. The driver wrote them before its answer,
// so they are already in the pipes unless a cell closed fds 1 or 2.
func (k *pyKernel) collect() (stdout, stderr agentproto.Stream) {
	get := func(d *demux) agentproto.Stream {
		select {
		case b := <-d.done:
			return b.Stream()
		case <-k.exited:
		case <-timeAfter(sentinelWait):
		}
		return d.flush().Stream()
	}
	return get(k.out), get(k.errs)
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
}

func lastLines(s string, n int) string {
	lines := strings.Split(strings.TrimSpace(s), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

var _ io.Writer = (*capBuf)(nil)
