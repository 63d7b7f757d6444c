package guestinit

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"os"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"kiln/internal/boxpolicy"
)

// serveSeed reseeds the kernel's RNG, sets the clock and configures the
// box's network (nw, from the plan; nil for none) from each seed message
// on the port, acknowledging each with one byte.
func serveSeed(path string, nw *boxpolicy.Network) error {
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
			seedFrom(f, rnd, nw)
			// EOF: no host end connected (a template being
			// saved, or a VM going away). Wait for one.
			time.Sleep(50 * time.Millisecond)
		}
	}()
	return nil
}

// serveSeedVsock serves seed messages on a vsock port: the host connects
// once per restore.
func serveSeedVsock(port uint32, nw *boxpolicy.Network) error {
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
			seedFrom(c, rnd, nw)
			c.Close()
		}
	}()
	return nil
}

// seedFrom applies seed messages from port until it fails.
func seedFrom(port io.ReadWriter, rnd *os.File, nw *boxpolicy.Network) {
	for {
		s, err := ReadSeed(port)
		if err != nil {
			return
		}
		reseed(int(rnd.Fd()), s.Entropy[:])
		ts := unix.NsecToTimespec(s.Time)
		unix.ClockSettime(unix.CLOCK_REALTIME, &ts)
		answer := byte(SeedOK)
		if err := seedNetwork(s, nw); err != nil {
			fmt.Fprintln(os.Stderr, "kiln guest:", err) // the console log
			answer = SeedFailed
		}
		port.Write([]byte{answer})
	}
}

// seedNetwork gives the box the address a seed carries, on the network
// its plan describes. A seed without an address changes nothing; one
// with an address for a guest whose plan has no network is refused, as
// is a trust bundle the plan does not expect.
func seedNetwork(s Seed, nw *boxpolicy.Network) error {
	addr := netip.AddrFrom4(s.Addr)
	switch {
	case addr.IsUnspecified() && len(s.TrustBundle) == 0:
		return nil
	case nw == nil:
		return errors.New("configuring network: the host sent an address, and the box plan has no network")
	case addr.IsUnspecified():
		return errors.New("configuring network: a trust bundle without an address")
	case (len(s.TrustBundle) > 0) != nw.TrustBundle:
		return fmt.Errorf("configuring network: trust bundle of %d bytes, and the plan says trust bundle %v", len(s.TrustBundle), nw.TrustBundle)
	}
	if err := configureNetwork(addr, nw); err != nil {
		return err
	}
	if nw.TrustBundle {
		return installTrustBundle(s.TrustBundle)
	}
	return nil
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
