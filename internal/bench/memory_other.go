//go:build !linux

package bench

import (
	"errors"
	"fmt"
	"time"
)

var errNoProc = fmt.Errorf("bench: memory figures need Linux's /proc: %w", errors.ErrUnsupported)

func finderFor(bool) boxFinder {
	return func(int) (map[string][]int, error) { return nil, errNoProc }
}

func sharedMemory(int, map[string][]int) (int64, bool) { return 0, false }

func readMemory(int) (memInfo, error) { return memInfo{}, errNoProc }

func processRole(int) string { return "?" }

type cpuGroup struct{}

func newCPUGroup() (*cpuGroup, error)                { return nil, errNoProc }
func (*cpuGroup) usage() (time.Duration, error)      { return 0, errNoProc }
func (*cpuGroup) groupsUsage([]string) time.Duration { return 0 }
func (*cpuGroup) close()                             {}
func (*cpuGroup) covers() string                     { return "" }
func selfCPU() time.Duration                         { return 0 }
func loadAverage() string                            { return "" }
