//go:build !linux

package bench

import "time"

func machineBusy() (time.Duration, error) { return 0, errNoProc }
