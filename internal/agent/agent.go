// Package agent is kiln-agent: the first process of every sandbox. It speaks
// the agentproto protocol with the host over one byte stream, runs cells in
// a persistent Python kernel, runs shell commands, and reads and writes
// files under the workspace. It runs inside the box and never imports
// host-side code.
package agent

import (
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"

	"kiln/internal/agentproto"
	"kiln/internal/boxpolicy"
)

const (
	defaultMaxOutput = agentproto.DefaultMaxOutput
	sentinelWait     = 2 * time.Second
	// ProtocolVersion is sent in Hello.
	ProtocolVersion = 1
)

var timeAfter = time.After

// liveInterval is how often a running call's output is sent, at most.
var liveInterval = agentproto.LiveInterval

// Config is how the agent was started.
type Config struct {
	Workspace string   // the workspace root, e.g. /work
	Python    string   // python3 to run the kernel with; "" for none
	Preload   []string // modules the kernel imports before Hello
	// UID and GID run code as this user when the agent itself runs as root
	// (a microVM guest). -1 keeps the agent's own user.
	UID, GID int
	// Cgroup, if set, is a cgroup (v2) directory the kernel and shell
	// commands start in, so its limits bind the code and not the agent (a
	// microVM guest's memory limit).
	Cgroup   string
	cgroupFD int
	// Plan is the digest of the box plan the box built itself from,
	// announced in the hello (agentproto.Hello.Plan): a microVM guest's.
	Plan string
	// Code, if not empty, is set on every process of code the agent starts
	// (codeexec.go): where nothing else bounds code per process (a
	// Kubernetes Pod under runc).
	Code CodeSetup
	self string // the agent's own executable, for ExecCode
	// Adopt, if set, is the kernel a jail zygote forked for this box; the
	// agent uses it instead of starting python itself (it starts a new
	// one only if that kernel dies).
	Adopt  *Adopted
	Logger *slog.Logger
}

// Agent serves one host connection.
type Agent struct {
	cfg *Config
	log *slog.Logger

	wmu sync.Mutex
	w   io.Writer
	// epoch counts the host's attaches (ServeAttached); a frame of a
	// request read in an older one is not sent. Guarded by wmu.
	epoch    uint64
	reqEpoch sync.Map // *agentproto.Request → the epoch it was read in

	kmu    sync.Mutex // held while a cell runs; cells are serialized
	kref   sync.Mutex // guards kernel
	kernel *pyKernel  // nil until started, or after it died

	smu    sync.Mutex
	shells map[*exec.Cmd]struct{}

	// The state archives (state.go), guarded by kmu.
	savePath, loadPath string
	loadSize           int64
}

// New returns an agent; call Serve.
func New(cfg Config) *Agent {
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	if cfg.Workspace == "" {
		cfg.Workspace = boxpolicy.Workspace
	}
	if !cfg.Code.empty() {
		if self, err := os.Executable(); err == nil {
			cfg.self = self
		}
	}
	if cfg.Cgroup != "" {
		if fd, err := syscall.Open(cfg.Cgroup, syscall.O_RDONLY|syscall.O_DIRECTORY|syscall.O_CLOEXEC, 0); err == nil {
			cfg.cgroupFD = fd
		} else {
			cfg.Logger.Warn("code cgroup unavailable; code is bounded by the box's own limits", "cgroup", cfg.Cgroup, "err", err)
		}
	}
	return &Agent{cfg: &cfg, log: cfg.Logger, shells: make(map[*exec.Cmd]struct{})}
}

// Serve starts the kernel, says hello, and answers requests on rw until it
// closes.
func (a *Agent) Serve(r io.Reader, w io.Writer) error {
	a.w = w
	hello := a.start()
	if err := a.send(hello); err != nil {
		return fmt.Errorf("sending hello: %w", err)
	}
	var wg sync.WaitGroup
	defer wg.Wait()
	err := a.serveFrames(r, &wg)
	a.shutdown()
	if errors.Is(err, io.EOF) {
		return nil
	}
	return err
}

// start prepares the box and its kernel and returns the hello to send.
func (a *Agent) start() *agentproto.Hello {
	// As the code's user: the agent holds no capability over files.
	a.asCode(func() error { makeHome(a.cfg); return nil })
	hello := agentproto.Hello{Version: ProtocolVersion, Plan: a.cfg.Plan}
	if a.cfg.Adopt != nil {
		k, err := adoptKernel(a.cfg.Adopt)
		if err != nil {
			a.log.Warn("adopted python kernel unavailable", "err", err)
		} else {
			a.kernel = k
			hello.Python = k.hello.Python
			hello.Preloaded = k.hello.Preloaded
		}
	} else if a.cfg.Python != "" {
		k, err := startKernel(a.cfg)
		if err != nil {
			a.log.Warn("python kernel unavailable", "err", err)
		} else {
			a.kernel = k
			hello.Python = k.hello.Python
			hello.Preloaded = k.hello.Preloaded
		}
	}
	return &hello
}

// serveFrames answers the requests on r until it ends, with the error that
// ended it (io.EOF at a frame boundary).
func (a *Agent) serveFrames(r io.Reader, wg *sync.WaitGroup) error {
	for {
		var req agentproto.Request
		if err := agentproto.ReadFrame(r, &req); err != nil {
			if errors.Is(err, io.EOF) {
				return io.EOF
			}
			return fmt.Errorf("reading request: %w", err)
		}
		a.wmu.Lock()
		a.reqEpoch.Store(&req, a.epoch)
		a.wmu.Unlock()
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer a.reqEpoch.Delete(&req)
			resp := a.handle(&req)
			resp.ID = req.ID
			if err := a.sendFor(&req, resp); err != nil {
				a.log.Warn("sending response", "err", err)
			}
		}()
	}
}

func (a *Agent) send(v any) error {
	a.wmu.Lock()
	defer a.wmu.Unlock()
	return a.sendLocked(v)
}

// sendFor sends a frame answering req, unless req was read before the
// host's latest attach: that host never asked for it.
func (a *Agent) sendFor(req *agentproto.Request, v any) error {
	a.wmu.Lock()
	defer a.wmu.Unlock()
	if e, ok := a.reqEpoch.Load(req); ok && e.(uint64) != a.epoch {
		return nil
	}
	return a.sendLocked(v)
}

func (a *Agent) sendLocked(v any) error {
	err := agentproto.WriteFrame(a.w, v)
	if errors.Is(err, agentproto.ErrFrameTooLarge) {
		if resp, ok := v.(*agentproto.Response); ok {
			return agentproto.WriteFrame(a.w, &agentproto.Response{ID: resp.ID, Error: "the result is larger than the protocol allows"})
		}
	}
	return err
}

func (a *Agent) handle(req *agentproto.Request) *agentproto.Response {
	var (
		resp = &agentproto.Response{}
		err  error
	)
	switch req.Op {
	case agentproto.OpPython:
		live, stop := a.streamLive(req)
		resp.Exec, err = a.runPython(req.Code, req.MaxOutput, live)
		stop()
	case agentproto.OpShell:
		live, stop := a.streamLive(req)
		resp.Exec, err = a.runShell(req.Code, req.MaxOutput, live)
		stop()
	case agentproto.OpInterrupt:
		a.interrupt()
	case agentproto.OpWrite:
		err = a.writeFile(req.Path, req.Data)
	case agentproto.OpRead:
		if resp.Data, resp.Size, err = a.readFile(req.Path, req.Offset, req.MaxBytes); err == nil {
			resp.Offset = req.Offset
		}
	case agentproto.OpList:
		resp.Files, err = a.listFiles(req.Path)
	case agentproto.OpChanges:
		resp.Files, err = a.changes(time.Unix(0, req.Since))
	case agentproto.OpSaveState:
		resp.State, resp.Size, err = a.saveState()
	case agentproto.OpReadState:
		if resp.Data, resp.Size, err = a.readState(req.Offset, req.MaxBytes); err == nil {
			resp.Offset = req.Offset
		}
	case agentproto.OpWriteState:
		err = a.writeState(req.Offset, req.Data)
	case agentproto.OpLoadState:
		resp.State, err = a.loadState()
	case agentproto.OpPing:
	default:
		err = fmt.Errorf("unknown operation %q", req.Op)
	}
	if err != nil {
		resp.Error = err.Error()
	}
	return resp
}

func (a *Agent) runPython(code string, maxOutput int, live *liveTail) (*agentproto.ExecResult, error) {
	a.kmu.Lock()
	defer a.kmu.Unlock()
	if a.cfg.Python == "" {
		return nil, errors.New("python is not available in this sandbox")
	}
	k := a.currentKernel()
	if k == nil {
		var err error
		if k, err = startKernel(a.cfg); err != nil {
			return nil, err
		}
		a.setKernel(k)
	}
	res, err := k.run(code, maxOutput, live)
	if errors.Is(err, errKernelDied) {
		k.kill()
		a.setKernel(nil) // the next cell starts a new one
		return res, nil
	}
	return res, err
}

// streamLive sends the newest output of req while it runs, if the host
// asked for it: an Output frame at most every LiveInterval, and only when
// there is new output. stop ends it before the answer is sent, so no
// Output frame follows the answer.
func (a *Agent) streamLive(req *agentproto.Request) (live *liveTail, stop func()) {
	if !req.Live {
		return nil, func() {}
	}
	live = &liveTail{}
	quit, finished := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(finished)
		t := time.NewTicker(liveInterval)
		defer t.Stop()
		for {
			select {
			case <-quit:
				return
			case <-t.C:
				if out, ok := live.take(); ok {
					if err := a.sendFor(req, &agentproto.Response{ID: req.ID, Output: &out}); err != nil {
						a.log.Warn("sending output", "err", err)
					}
				}
			}
		}
	}()
	return live, func() { close(quit); <-finished }
}

func (a *Agent) currentKernel() *pyKernel {
	a.kref.Lock()
	defer a.kref.Unlock()
	return a.kernel
}

func (a *Agent) setKernel(k *pyKernel) {
	a.kref.Lock()
	a.kernel = k
	a.kref.Unlock()
}

func (a *Agent) interrupt() {
	a.smu.Lock()
	for cmd := range a.shells {
		interruptGroup(cmd)
	}
	a.smu.Unlock()
	if k := a.currentKernel(); k != nil {
		k.interrupt() // only signals when a cell is running
	}
}

func (a *Agent) shutdown() {
	a.smu.Lock()
	for cmd := range a.shells {
		if cmd.Process != nil {
			syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
		}
	}
	a.smu.Unlock()
	if k := a.currentKernel(); k != nil {
		k.kill()
	}
}

// childEnv is the environment of the kernel and of shell commands: the
// agent's own (the backend gave it a clean one) with the basics filled in.
func childEnv(cfg *Config) []string {
	env := os.Environ()
	if h := os.Getenv("HOME"); h != homeOf(cfg) {
		env = slices.DeleteFunc(env, func(kv string) bool { return kv == "HOME="+h }) // "/" (a kernel's init) or the workspace
	}
	// The box plan's environment, wherever the backend left it out (a
	// microVM's init starts the agent with none).
	for _, kv := range boxpolicy.Env {
		k, _, _ := strings.Cut(kv, "=")
		if !slices.ContainsFunc(env, func(e string) bool { return strings.HasPrefix(e, k+"=") }) {
			env = append(env, kv)
		}
	}
	return env
}

func childAttr(cfg *Config) *syscall.SysProcAttr {
	attr := &syscall.SysProcAttr{Setpgid: true}
	if os.Getuid() == 0 && cfg.UID >= 0 {
		// Code inherits the agent's supplementary groups: none, since
		// Harden dropped them where it could.
		attr.Credential = &syscall.Credential{Uid: uint32(cfg.UID), Gid: uint32(cfg.GID), NoSetGroups: true}
	}
	if cfg.cgroupFD > 0 {
		setCgroupFD(attr, cfg.cgroupFD)
	}
	return attr
}

func unixSignalName(s syscall.Signal) string {
	switch s {
	case syscall.SIGKILL:
		return "SIGKILL"
	case syscall.SIGTERM:
		return "SIGTERM"
	case syscall.SIGINT:
		return "SIGINT"
	case syscall.SIGSEGV:
		return "SIGSEGV"
	case syscall.SIGABRT:
		return "SIGABRT"
	case syscall.SIGXCPU:
		return "SIGXCPU"
	case syscall.SIGXFSZ:
		return "SIGXFSZ"
	case syscall.SIGBUS:
		return "SIGBUS"
	}
	return fmt.Sprintf("signal %d", int(s))
}
