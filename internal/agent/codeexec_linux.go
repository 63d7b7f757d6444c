package agent

import (
	"fmt"
	"os"
	"strconv"
	"syscall"

	"kiln/internal/boxpolicy"
)

// applyCodeSetup sets s on the calling process. syscall.Setrlimit (not
// x/sys's) so that Go's exec does not put back the soft RLIMIT_NOFILE it
// found at start.
func applyCodeSetup(s CodeSetup) error {
	for _, r := range s.Rlimits {
		res, _ := boxpolicy.RlimitResource(r.Name) // parseRlimit took only its names
		if err := syscall.Setrlimit(res, &syscall.Rlimit{Cur: r.Value, Max: r.Value}); err != nil {
			return fmt.Errorf("setting %s to %d: %w", r.Name, r.Value, err)
		}
	}
	if s.OOMScoreAdj != 0 {
		if err := os.WriteFile("/proc/self/oom_score_adj", []byte(strconv.Itoa(s.OOMScoreAdj)), 0); err != nil {
			return fmt.Errorf("setting oom_score_adj: %w", err)
		}
	}
	return nil
}

func execve(path string, argv, env []string) error {
	return syscall.Exec(path, argv, env)
}
