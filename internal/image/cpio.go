package image

import (
	"fmt"
	"io"
	"strings"
)

// cpioWriter writes a newc ("070701") cpio archive, the format the Linux
// kernel unpacks as an initramfs. Writing it here keeps the build free of
// cpio(1) and of root-only mknod calls.
type cpioWriter struct {
	w     io.Writer
	ino   uint32
	off   int64
	err   error
	ended bool
}

// File modes of the entries.
const (
	cpioDir  = 0o040000
	cpioReg  = 0o100000
	cpioChr  = 0o020000
	cpioLink = 0o120000
)

func newCpio(w io.Writer) *cpioWriter { return &cpioWriter{w: w} }

func (c *cpioWriter) header(name string, mode uint32, size int64, rmaj, rmin uint32) {
	if c.err != nil {
		return
	}
	name = strings.TrimPrefix(name, "/")
	c.ino++
	hdr := fmt.Sprintf("070701%08x%08x%08x%08x%08x%08x%08x%08x%08x%08x%08x%08x%08x",
		c.ino, mode, 0, 0, 1, 0, size, 0, 0, rmaj, rmin, len(name)+1, 0)
	c.write([]byte(hdr))
	c.write([]byte(name + "\x00"))
	c.pad()
}

func (c *cpioWriter) write(b []byte) {
	if c.err != nil {
		return
	}
	n, err := c.w.Write(b)
	c.off += int64(n)
	c.err = err
}

func (c *cpioWriter) pad() {
	if r := c.off % 4; r != 0 {
		c.write(make([]byte, 4-r))
	}
}

// Dir adds a directory.
func (c *cpioWriter) Dir(name string, perm uint32) { c.header(name, cpioDir|perm, 0, 0, 0) }

// File adds a regular file with the given content.
func (c *cpioWriter) File(name string, perm uint32, data []byte) {
	c.header(name, cpioReg|perm, int64(len(data)), 0, 0)
	c.write(data)
	c.pad()
}

// CharDev adds a character device node.
func (c *cpioWriter) CharDev(name string, perm, major, minor uint32) {
	c.header(name, cpioChr|perm, 0, major, minor)
}

// Close writes the trailer.
func (c *cpioWriter) Close() error {
	if !c.ended {
		c.ended = true
		c.header("TRAILER!!!", 0, 0, 0, 0)
	}
	return c.err
}
