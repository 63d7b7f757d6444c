package agent

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"

	"kiln/internal/boxpolicy"
)

// Where nothing outside the agent bounds code on its own (a Kubernetes Pod
// under runc: one container holds the agent and the code, and the runtime
// sets no per-process limits), the agent sets them on every process of
// code it starts: the box plan's rlimits (RLIMIT_NPROC counts the
// processes of the code's uid, which is the box's own, so it is the box's
// pids limit; the agent runs as root, which the kernel exempts, so a fork
// bomb never stops the agent from answering) and an oom_score_adj of 1000,
// so that when the box's memory is exhausted the kernel's OOM killer takes
// code and never the agent.
//
// Both must hold from code's first instruction: a shell command that forks
// before the agent could reach it would leave children with the agent's
// values. Go's exec starts a child with no hook between fork and exec, so
// code starts through kiln-agent itself, re-executed with ExecCodeArg as
// its first argument: as the code's user already, it sets the limits on
// itself (lowering an rlimit and raising oom_score_adj need no privilege)
// and executes the code's program in its place.

// ExecCodeArg, as kiln-agent's first argument, makes it ExecCode.
const ExecCodeArg = "-exec-code"

// CodeSetup is what the agent sets on every process of code before it runs.
// The zero value sets nothing, and code starts directly.
type CodeSetup struct {
	Rlimits []boxpolicy.Rlimit
	// OOMScoreAdj, if not 0, is written to the code's oom_score_adj.
	OOMScoreAdj int
}

func (s CodeSetup) empty() bool { return len(s.Rlimits) == 0 && s.OOMScoreAdj == 0 }

// args are ExecCode's arguments before "--".
func (s CodeSetup) args() []string {
	var out []string
	if s.OOMScoreAdj != 0 {
		out = append(out, "oom="+strconv.Itoa(s.OOMScoreAdj))
	}
	for _, r := range s.Rlimits {
		out = append(out, "rlimit="+r.Name+"="+strconv.FormatUint(r.Value, 10))
	}
	return out
}

// ParseRlimits reads rlimits written as NAME=VALUE[,NAME=VALUE...]
// ("RLIMIT_NPROC=64,RLIMIT_NOFILE=1024"). Only the limits the box plan
// uses are known.
func ParseRlimits(s string) ([]boxpolicy.Rlimit, error) {
	var out []boxpolicy.Rlimit
	for _, kv := range strings.Split(s, ",") {
		if kv = strings.TrimSpace(kv); kv == "" {
			continue
		}
		r, err := parseRlimit(kv)
		if err != nil {
			return nil, err
		}
		out = append(out, r)
	}
	return out, nil
}

func parseRlimit(kv string) (boxpolicy.Rlimit, error) {
	name, v, ok := strings.Cut(kv, "=")
	if !ok {
		return boxpolicy.Rlimit{}, fmt.Errorf("rlimit %q: want NAME=VALUE", kv)
	}
	if _, known := boxpolicy.RlimitResource(name); !known {
		return boxpolicy.Rlimit{}, fmt.Errorf("rlimit %q: unknown resource %s", kv, name)
	}
	n, err := strconv.ParseUint(v, 10, 64)
	if err != nil {
		return boxpolicy.Rlimit{}, fmt.Errorf("rlimit %q: %w", kv, err)
	}
	return boxpolicy.Rlimit{Name: name, Value: n}, nil
}

// codeCommand is exec.Command for a program of code: started through
// ExecCode when cfg has a CodeSetup.
func codeCommand(cfg *Config, name string, args ...string) *exec.Cmd {
	if cfg.Code.empty() {
		return exec.Command(name, args...)
	}
	self := cfg.self
	if self == "" {
		self = "/proc/self/exe"
	}
	a := append(append([]string{ExecCodeArg}, cfg.Code.args()...), "--", name)
	return exec.Command(self, append(a, args...)...)
}

// ExecCode is kiln-agent started as ExecCodeArg's args: the setup (see
// CodeSetup.args), "--", then the program to run and its arguments. It
// applies the setup to its own process and executes the program; it
// returns only if it could not.
func ExecCode(args []string) error {
	var s CodeSetup
	i := 0
	for ; i < len(args) && args[i] != "--"; i++ {
		k, v, _ := strings.Cut(args[i], "=")
		switch k {
		case "oom":
			n, err := strconv.Atoi(v)
			if err != nil || n < -1000 || n > 1000 {
				return fmt.Errorf("bad oom_score_adj %q", v)
			}
			s.OOMScoreAdj = n
		case "rlimit":
			r, err := parseRlimit(v)
			if err != nil {
				return err
			}
			s.Rlimits = append(s.Rlimits, r)
		default:
			return fmt.Errorf("unknown setup %q", args[i])
		}
	}
	if i+1 >= len(args) {
		return errors.New("no program to run")
	}
	prog, argv := args[i+1], args[i+1:]
	if err := applyCodeSetup(s); err != nil {
		return err
	}
	path, err := exec.LookPath(prog)
	if err != nil {
		return err
	}
	return execve(path, argv, os.Environ())
}
