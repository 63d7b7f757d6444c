package guestinit

import (
	"encoding/binary"
	"fmt"
	"io"
	"os"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// serveSeed reseeds the kernel's RNG and sets the clock from each seed
// message on the port, acknowledging each with one byte.
func serveSeed(path string) error {
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		return fmt.Errorf("opening seed port: %w", err)
	}
	rnd, err := os.OpenFile("/dev/random", os.O_WRONLY, 0)
	if err != nil {
		f.Close()
		return fmt.Errorf("opening /dev/random: %w", err)
	}
	go func() {
		for {
			seedFrom(f, rnd)
			// EOF: no host end connected (a template being
			// saved, or a VM going away). Wait for one.
			time.Sleep(50 * time.Millisecond)
		}
	}()
	return nil
}

// serveSeedVsock serves seed messages on a vsock port: the host connects
// once per restore.
func serveSeedVsock(port uint32) error {
	rnd, err := os.OpenFile("/dev/random", os.O_WRONLY, 0)
	if err != nil {
		return fmt.Errorf("opening /dev/random: %w", err)
	}
	accept, err := listenVsock(port)
	if err != nil {
		rnd.Close()
		return err
	}
	go func() {
		for {
			c, err := accept()
			if err != nil {
				return
			}
			seedFrom(c, rnd)
			c.Close()
		}
	}()
	return nil
}

// seedFrom applies seed messages from port until it fails.
func seedFrom(port io.ReadWriter, rnd *os.File) {
	msg := make([]byte, SeedMessageSize)
	for {
		if _, err := io.ReadFull(port, msg); err != nil {
			return
		}
		reseed(int(rnd.Fd()), msg[:SeedSize])
		ns := int64(binary.BigEndian.Uint64(msg[SeedSize:]))
		ts := unix.NsecToTimespec(ns)
		unix.ClockSettime(unix.CLOCK_REALTIME, &ts)
		port.Write([]byte{1})
	}
}

// reseed credits data to the input pool and reseeds the CRNG from it.
func reseed(fd int, data []byte) {
	// struct rand_pool_info { int entropy_count; int buf_size; __u32 buf[]; }
	info := make([]byte, 8+(len(data)+3)&^3)
	binary.NativeEndian.PutUint32(info[0:], uint32(len(data)*8))
	binary.NativeEndian.PutUint32(info[4:], uint32(len(data)))
	copy(info[8:], data)
	unix.Syscall(unix.SYS_IOCTL, uintptr(fd), unix.RNDADDENTROPY, uintptr(unsafe.Pointer(&info[0])))
	unix.Syscall(unix.SYS_IOCTL, uintptr(fd), unix.RNDRESEEDCRNG, 0)
}
