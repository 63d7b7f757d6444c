package guestinit

import (
	"fmt"
	"io"
	"os"
	"sync"

	"golang.org/x/sys/unix"
)

// A socket cannot be opened by path, and the agent opens its stream by path;
// a host-initiated vsock connection (Firecracker) is also replaced after
// every snapshot restore. So for vsock, PID 1 bridges: it accepts
// connections on the port and copies between the current one and the
// master side of a raw pseudo-terminal, whose slave path Setup returns.
// The agent's stream survives a restore; only the socket under it changes.

// ptyPair opens a pseudo-terminal in raw mode and returns its master and
// the path of its slave. The slave is kept open so its mode stays set.
func ptyPair() (master *os.File, slave string, err error) {
	master, err = os.OpenFile("/dev/pts/ptmx", os.O_RDWR|unix.O_NOCTTY|unix.O_CLOEXEC, 0)
	if err != nil {
		master, err = os.OpenFile("/dev/ptmx", os.O_RDWR|unix.O_NOCTTY|unix.O_CLOEXEC, 0)
	}
	if err != nil {
		return nil, "", fmt.Errorf("opening pty: %w", err)
	}
	fd := int(master.Fd())
	if err := unix.IoctlSetPointerInt(fd, unix.TIOCSPTLCK, 0); err != nil {
		master.Close()
		return nil, "", fmt.Errorf("unlocking pty: %w", err)
	}
	n, err := unix.IoctlGetInt(fd, unix.TIOCGPTN)
	if err != nil {
		master.Close()
		return nil, "", fmt.Errorf("naming pty: %w", err)
	}
	slave = fmt.Sprintf("/dev/pts/%d", n)
	sfd, err := unix.Open(slave, unix.O_RDWR|unix.O_NOCTTY|unix.O_CLOEXEC, 0)
	if err != nil {
		master.Close()
		return nil, "", fmt.Errorf("opening pty slave: %w", err)
	}
	tio, err := unix.IoctlGetTermios(sfd, unix.TCGETS)
	if err == nil {
		makeRaw(tio)
		err = unix.IoctlSetTermios(sfd, unix.TCSETS, tio)
	}
	if err != nil {
		master.Close()
		unix.Close(sfd)
		return nil, "", fmt.Errorf("making pty raw: %w", err)
	}
	return master, slave, nil // sfd stays open for the life of PID 1
}

// makeRaw is cfmakeraw(3): bytes pass unchanged, no echo, no signals.
func makeRaw(t *unix.Termios) {
	t.Iflag &^= unix.IGNBRK | unix.BRKINT | unix.PARMRK | unix.ISTRIP | unix.INLCR | unix.IGNCR | unix.ICRNL | unix.IXON | unix.IXOFF
	t.Oflag &^= unix.OPOST
	t.Lflag &^= unix.ECHO | unix.ECHONL | unix.ICANON | unix.ISIG | unix.IEXTEN
	t.Cflag &^= unix.CSIZE | unix.PARENB
	t.Cflag |= unix.CS8
	t.Cc[unix.VMIN] = 1
	t.Cc[unix.VTIME] = 0
}

// bridge copies between master and whichever connection accept returned
// last. Bytes from master wait until a connection exists; a write to a
// dead connection is retried on the next one.
type bridge struct {
	master io.ReadWriter
	mu     sync.Mutex
	cond   *sync.Cond
	conn   io.ReadWriteCloser
}

func newBridge(master io.ReadWriter) *bridge {
	b := &bridge{master: master}
	b.cond = sync.NewCond(&b.mu)
	return b
}

// serve runs until accept fails.
func (b *bridge) serve(accept func() (io.ReadWriteCloser, error)) error {
	go b.fromMaster()
	for {
		c, err := accept()
		if err != nil {
			return err
		}
		b.mu.Lock()
		if b.conn != nil {
			b.conn.Close()
		}
		b.conn = c
		b.cond.Broadcast()
		b.mu.Unlock()
		go func() {
			io.Copy(b.master, c)
			b.drop(c)
		}()
	}
}

func (b *bridge) drop(c io.ReadWriteCloser) {
	b.mu.Lock()
	if b.conn == c {
		b.conn = nil
	}
	b.mu.Unlock()
	c.Close()
}

func (b *bridge) fromMaster() {
	buf := make([]byte, 64<<10)
	for {
		n, err := b.master.Read(buf)
		if err != nil {
			return
		}
		for {
			b.mu.Lock()
			for b.conn == nil {
				b.cond.Wait()
			}
			c := b.conn
			b.mu.Unlock()
			if _, err := c.Write(buf[:n]); err == nil {
				break
			}
			b.drop(c)
		}
	}
}

// vsockStream listens on the vsock port and returns the pty slave path
// that the bridge serves.
func vsockStream(port uint32) (string, error) {
	master, slave, err := ptyPair()
	if err != nil {
		return "", err
	}
	accept, err := listenVsock(port)
	if err != nil {
		return "", err
	}
	go newBridge(master).serve(accept)
	return slave, nil
}

// listenVsock listens on a vsock port and returns its accept.
func listenVsock(port uint32) (func() (io.ReadWriteCloser, error), error) {
	fd, err := unix.Socket(unix.AF_VSOCK, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("opening vsock: %w", err)
	}
	if err := unix.Bind(fd, &unix.SockaddrVM{CID: unix.VMADDR_CID_ANY, Port: port}); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("binding vsock port %d: %w", port, err)
	}
	if err := unix.Listen(fd, 4); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("listening on vsock: %w", err)
	}
	return func() (io.ReadWriteCloser, error) {
		nfd, _, err := unix.Accept4(fd, unix.SOCK_CLOEXEC)
		if err != nil {
			return nil, err
		}
		return os.NewFile(uintptr(nfd), "vsock"), nil
	}, nil
}
