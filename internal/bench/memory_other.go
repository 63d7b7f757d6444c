//go:build !linux

package bench

import (
	"errors"
	"fmt"
)

var errNoProc = fmt.Errorf("bench: memory figures need Linux's /proc: %w", errors.ErrUnsupported)

func finderFor(string) boxFinder {
	return func(int) (map[string][]int, error) { return nil, errNoProc }
}

func sharedMemory(int, map[string][]int) (int64, bool) { return 0, false }

func readMemory(int) (memInfo, error) { return memInfo{}, errNoProc }
