package boxkit

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
)

// MemoryUsage is the memory charged to the group now, in bytes (v2
// memory.current, v1 memory.usage_in_bytes); -1 if it cannot be read (the
// group is gone).
func (g *CgroupGroup) MemoryUsage() int64 {
	file := "memory.usage_in_bytes"
	if g.c.v2 {
		file = "memory.current"
	}
	b, err := os.ReadFile(filepath.Join(g.dir("memory"), file))
	if err != nil {
		return -1
	}
	n, err := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
	if err != nil || n < 0 {
		return -1
	}
	return n
}
