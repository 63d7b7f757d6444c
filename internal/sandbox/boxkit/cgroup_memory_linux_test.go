package boxkit

import (
	"path/filepath"
	"testing"
)

func TestCgroupMemoryUsage(t *testing.T) {
	for _, tc := range []struct {
		v2   bool
		file string
	}{{true, "memory.current"}, {false, "memory.usage_in_bytes"}} {
		c := CgroupsAt(fakeCgroupfs(t, tc.v2))
		if _, err := c.CreateParent("kiln/1"); err != nil {
			t.Fatal(err)
		}
		g, err := c.Create("kiln/1/box", CgroupLimits{})
		if err != nil {
			t.Fatal(err)
		}
		if n := g.MemoryUsage(); n != -1 {
			t.Errorf("v2=%v: MemoryUsage without %s = %d, want -1 (unknown)", tc.v2, tc.file, n)
		}
		dir := g.dir("memory")
		writeFile(t, filepath.Join(dir, tc.file), "12345678\n")
		if n := g.MemoryUsage(); n != 12345678 {
			t.Errorf("v2=%v: MemoryUsage = %d, want %s's 12345678", tc.v2, n, tc.file)
		}
		writeFile(t, filepath.Join(dir, tc.file), "garbage")
		if n := g.MemoryUsage(); n != -1 {
			t.Errorf("v2=%v: MemoryUsage of garbage = %d, want -1", tc.v2, n)
		}
	}
}
