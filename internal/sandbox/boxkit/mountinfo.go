package boxkit

import (
	"bufio"
	"fmt"
	"io"
	"os"
	"sort"
	"strconv"
	"strings"
)

// Mount is one line of /proc/<pid>/mountinfo (see proc(5)), with the
// kernel's octal escapes (\040 space, \011 tab, \012 newline, \134
// backslash) undone.
type Mount struct {
	ID, Parent   int
	Root         string // the root of the mount within its filesystem
	Point        string // the mount point
	Options      string // per-mount options
	FSType       string
	Source       string
	SuperOptions string // per-superblock options (v1 cgroup controllers, say)
}

// ParseMountinfo reads mountinfo lines from r. Lines it cannot make sense
// of are skipped.
func ParseMountinfo(r io.Reader) ([]Mount, error) {
	var out []Mount
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		if m, ok := parseMountinfoLine(sc.Text()); ok {
			out = append(out, m)
		}
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("reading mountinfo: %w", err)
	}
	return out, nil
}

// parseMountinfoLine parses
// "36 35 98:0 /mnt1 /mnt/parent rw,noatime master:1 - ext3 /dev/root rw".
// The optional fields before "-" vary in number.
func parseMountinfoLine(line string) (Mount, bool) {
	pre, post, ok := strings.Cut(line, " - ")
	if !ok {
		return Mount{}, false
	}
	f, g := strings.Fields(pre), strings.Fields(post)
	if len(f) < 6 || len(g) < 2 {
		return Mount{}, false
	}
	id, err1 := strconv.Atoi(f[0])
	parent, err2 := strconv.Atoi(f[1])
	if err1 != nil || err2 != nil {
		return Mount{}, false
	}
	m := Mount{
		ID: id, Parent: parent,
		Root:    mountinfoUnescape(f[3]),
		Point:   mountinfoUnescape(f[4]),
		Options: f[5],
		FSType:  g[0],
		Source:  mountinfoUnescape(g[1]),
	}
	if len(g) > 2 {
		m.SuperOptions = g[2]
	}
	return m, true
}

// mountinfoUnescape undoes the octal escapes of mountinfo.
func mountinfoUnescape(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+4 <= len(s) {
			if n, err := strconv.ParseUint(s[i+1:i+4], 8, 8); err == nil {
				b.WriteByte(byte(n))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

// ReadMountinfo parses this process's /proc/self/mountinfo.
func ReadMountinfo() ([]Mount, error) {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return nil, fmt.Errorf("reading mounts: %w", err)
	}
	defer f.Close()
	return ParseMountinfo(f)
}

// MountsUnder lists the mount points of this mount namespace at or below
// dir, deepest first (the order to unmount them in).
func MountsUnder(dir string) ([]string, error) {
	mounts, err := ReadMountinfo()
	if err != nil {
		return nil, err
	}
	var out []string
	for _, m := range mounts {
		if m.Point == dir || strings.HasPrefix(m.Point, dir+"/") {
			out = append(out, m.Point)
		}
	}
	sort.SliceStable(out, func(i, j int) bool { return len(out[i]) > len(out[j]) })
	return out, nil
}
