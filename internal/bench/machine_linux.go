package bench

import (
	"os"
	"time"
)

// machineBusy is the machine's busy CPU time since boot.
func machineBusy() (time.Duration, error) {
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		return 0, err
	}
	return parseProcStat(b)
}
