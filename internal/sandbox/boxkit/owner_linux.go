package boxkit

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
)

// Owner identifies a process across pid reuse: its pid and its start time
// (clock ticks after boot, field 22 of /proc/<pid>/stat). Backends stamp
// what they leave on the host (state directories, mount points, cgroups)
// with the Owner of the server process, so that a later server can tell
// what a dead one left from what a live one still uses.
type Owner struct {
	PID   int
	Start uint64
}

// Self is the Owner of this process.
func Self() Owner { return self() }

var self = sync.OnceValue(func() Owner {
	o, ok := Stamp(os.Getpid())
	if !ok {
		// Only without /proc; a stamp no process has.
		return Owner{PID: os.Getpid()}
	}
	return o
})

// Stamp is the Owner of the live process pid; false if there is none. A
// zombie is not live: a killed server whose parent has not reaped it yet
// owns nothing.
func Stamp(pid int) (Owner, bool) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return Owner{}, false
	}
	s := string(b)
	// The command name (field 2) may hold spaces and parentheses.
	if i := strings.LastIndexByte(s, ')'); i >= 0 {
		s = s[i+1:]
	}
	f := strings.Fields(s)
	if len(f) < 20 || f[0] == "Z" || f[0] == "X" { // field 3: state
		return Owner{}, false
	}
	start, err := strconv.ParseUint(f[19], 10, 64) // field 22: starttime
	if err != nil {
		return Owner{}, false
	}
	return Owner{PID: pid, Start: start}, true
}

// Alive reports whether the process pid that started at start still runs
// (and is not a zombie). It is the one liveness test of kiln's orphan
// sweeps.
func Alive(pid int, start uint64) bool {
	o, ok := Stamp(pid)
	return ok && o.Start == start
}

// Alive reports whether o still runs.
func (o Owner) Alive() bool { return Alive(o.PID, o.Start) }

// String is the stamp as names carry it: "<pid>.<start>".
func (o Owner) String() string {
	return strconv.Itoa(o.PID) + "." + strconv.FormatUint(o.Start, 10)
}

// ParseOwner reads the stamp at the start of s, "<pid>.<start>" (or
// "<pid> <start>"), and returns what follows it. ok is false unless both
// numbers are there and the stamp ends s or is followed by a separator
// ('.', '-', ' ' or a newline).
func ParseOwner(s string) (o Owner, rest string, ok bool) {
	pid, s, ok := ownerDigits(s)
	if !ok || len(s) == 0 || (s[0] != '.' && s[0] != ' ') {
		return Owner{}, "", false
	}
	start, s, ok := ownerDigits(s[1:])
	if !ok || (len(s) > 0 && !strings.ContainsRune(".- \n", rune(s[0]))) {
		return Owner{}, "", false
	}
	p, err := strconv.Atoi(pid)
	if err != nil || p <= 0 {
		return Owner{}, "", false
	}
	st, err := strconv.ParseUint(start, 10, 64)
	if err != nil {
		return Owner{}, "", false
	}
	return Owner{PID: p, Start: st}, s, true
}

// ownerDigits splits the leading decimal digits off s.
func ownerDigits(s string) (digits, rest string, ok bool) {
	i := 0
	for i < len(s) && s[i] >= '0' && s[i] <= '9' {
		i++
	}
	return s[:i], s[i:], i > 0
}

// SweepOrphans removes what dead servers left in dir: every entry whose
// name is prefix, an owner stamp, and a separator or nothing, and whose
// owner no longer runs, is handed to remove. Entries without a stamp are
// left alone. It returns how many entries remove took, and the errors of
// the others.
func SweepOrphans(dir, prefix string, remove func(path string) error) (removed int, err error) {
	entries, err := os.ReadDir(dir)
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return 0, nil
		}
		return 0, fmt.Errorf("reading %s: %w", dir, err)
	}
	var errs []error
	for _, e := range entries {
		rest, ok := strings.CutPrefix(e.Name(), prefix)
		if !ok {
			continue
		}
		o, _, ok := ParseOwner(rest)
		if !ok || o.Alive() {
			continue
		}
		if err := remove(filepath.Join(dir, e.Name())); err != nil {
			errs = append(errs, err)
			continue
		}
		removed++
	}
	return removed, errors.Join(errs...)
}
