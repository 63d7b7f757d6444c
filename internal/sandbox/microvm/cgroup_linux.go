package microvm

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"time"
)

const cgroupRoot = "/sys/fs/cgroup"

// cgroup is one VM's QEMU cgroup: a directory per v1 hierarchy, or one
// under the v2 unified hierarchy.
type cgroup struct {
	dirs []string
}

// cgroupLimits are what a QEMU process may use: guest RAM plus the VMM's
// own overhead, its threads, CPU bandwidth.
type cgroupLimits struct {
	MemoryBytes int64
	Pids        int
	CPUs        float64
}

const cpuPeriod = 100000 // µs

// newCgroup creates parent/id with limits, on cgroup v2 if the host has the
// unified hierarchy at /sys/fs/cgroup, else on v1's memory, pids and cpu.
func newCgroup(parent, id string, l cgroupLimits) (*cgroup, error) {
	quota := int64(l.CPUs * cpuPeriod)
	if _, err := os.Stat(filepath.Join(cgroupRoot, "cgroup.controllers")); err == nil {
		p := filepath.Join(cgroupRoot, parent)
		if err := os.MkdirAll(p, 0o755); err != nil {
			return nil, fmt.Errorf("creating cgroup: %w", err)
		}
		for _, d := range []string{cgroupRoot, p} {
			// Best effort: the controllers may be enabled already, or
			// owned by the service manager.
			os.WriteFile(filepath.Join(d, "cgroup.subtree_control"), []byte("+memory +pids +cpu"), 0)
		}
		c := &cgroup{dirs: []string{filepath.Join(p, id)}}
		if err := os.Mkdir(c.dirs[0], 0o755); err != nil {
			return nil, fmt.Errorf("creating cgroup: %w", err)
		}
		err := errors.Join(
			write(c.dirs[0], "memory.max", strconv.FormatInt(l.MemoryBytes, 10)),
			write(c.dirs[0], "memory.swap.max", "0"),
			write(c.dirs[0], "pids.max", strconv.Itoa(l.Pids)),
			write(c.dirs[0], "cpu.max", fmt.Sprintf("%d %d", quota, cpuPeriod)),
		)
		if err != nil {
			c.remove()
			return nil, fmt.Errorf("limiting cgroup: %w", err)
		}
		return c, nil
	}
	c := new(cgroup)
	settings := []struct{ ctrl, file, value string }{
		{"memory", "memory.limit_in_bytes", strconv.FormatInt(l.MemoryBytes, 10)},
		{"pids", "pids.max", strconv.Itoa(l.Pids)},
		{"cpu", "cpu.cfs_period_us", strconv.Itoa(cpuPeriod)},
		{"cpu", "cpu.cfs_quota_us", strconv.FormatInt(quota, 10)},
	}
	for _, s := range settings {
		dir := filepath.Join(cgroupRoot, s.ctrl, parent, id)
		if len(c.dirs) == 0 || c.dirs[len(c.dirs)-1] != dir {
			if err := os.MkdirAll(dir, 0o755); err != nil {
				c.remove()
				return nil, fmt.Errorf("creating cgroup: %w", err)
			}
			c.dirs = append(c.dirs, dir)
		}
		if err := write(dir, s.file, s.value); err != nil {
			c.remove()
			return nil, fmt.Errorf("limiting cgroup: %w", err)
		}
	}
	return c, nil
}

func write(dir, file, value string) error {
	return os.WriteFile(filepath.Join(dir, file), []byte(value), 0)
}

// add moves a process (all its threads) into the cgroup.
func (c *cgroup) add(pid int) error {
	for _, d := range c.dirs {
		if err := write(d, "cgroup.procs", strconv.Itoa(pid)); err != nil {
			return fmt.Errorf("joining cgroup: %w", err)
		}
	}
	return nil
}

// remove deletes the cgroup once its processes are gone.
func (c *cgroup) remove() error {
	var errs []error
	for _, d := range c.dirs {
		var err error
		for range 50 { // the kernel may take a moment to empty it
			if err = os.Remove(d); err == nil || errors.Is(err, os.ErrNotExist) {
				err = nil
				break
			}
			time.Sleep(10 * time.Millisecond)
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("removing cgroup: %w", err))
		}
	}
	return errors.Join(errs...)
}
