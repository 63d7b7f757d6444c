// Command probe is the one file of the smoke test's image. With no
// arguments it waits for SIGTERM (the container's main process); with
// "echo" it prints its other arguments, and with "id" the user and group
// it runs as, so a test can exec into the container and read an answer.
// For the NetworkPolicy test: "serve PORT" listens on TCP PORT until
// SIGTERM; "dial ADDR..." says which TCP addresses accept a connection;
// "udp ADDR..." which UDP addresses answer a datagram; "dns" which of
// /etc/resolv.conf's nameservers answer a query.
package main

import (
	"bufio"
	"fmt"
	"net"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"
)

func main() {
	if len(os.Args) < 2 {
		wait()
		return
	}
	switch os.Args[1] {
	case "echo":
		fmt.Println(strings.Join(os.Args[2:], " "))
	case "id":
		fmt.Printf("uid=%d gid=%d\n", os.Getuid(), os.Getgid())
	case "serve":
		if len(os.Args) != 3 {
			fail("usage: probe serve PORT")
		}
		serve(os.Args[2])
	case "dial":
		for _, a := range os.Args[2:] {
			c, err := net.DialTimeout("tcp", a, 2*time.Second)
			if err != nil {
				fmt.Printf("CLOSED %s\n", a)
				continue
			}
			c.Close()
			fmt.Printf("OPEN %s\n", a)
		}
	case "udp":
		for _, a := range os.Args[2:] {
			fmt.Printf("%s %s\n", udp(a, []byte("ping")), a)
		}
	case "dns":
		for _, ns := range nameservers() {
			a := net.JoinHostPort(ns, "53")
			// A query for example.com, type A.
			q := []byte("\x12\x34\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00\x07example\x03com\x00\x00\x01\x00\x01")
			fmt.Printf("%s %s\n", udp(a, q), a)
		}
	default:
		fail(fmt.Sprintf("unknown command %q", os.Args[1]))
	}
}

func fail(msg string) {
	fmt.Fprintln(os.Stderr, "probe: "+msg)
	os.Exit(2)
}

func wait() {
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGINT, syscall.SIGTERM)
	<-sig
}

// serve accepts and closes TCP connections on port until SIGTERM.
func serve(port string) {
	l, err := net.Listen("tcp", ":"+port)
	if err != nil {
		fail(err.Error())
	}
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			c.Close()
		}
	}()
	wait()
}

// udp sends b to addr and says whether anything came back within 2 s.
func udp(addr string, b []byte) string {
	c, err := net.Dial("udp", addr)
	if err != nil {
		return "NONE"
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(2 * time.Second))
	if _, err := c.Write(b); err != nil {
		return "NONE"
	}
	if _, err := c.Read(make([]byte, 512)); err != nil {
		return "NONE"
	}
	return "ANSWER"
}

func nameservers() []string {
	f, err := os.Open("/etc/resolv.conf")
	if err != nil {
		return nil
	}
	defer f.Close()
	var ns []string
	s := bufio.NewScanner(f)
	for s.Scan() {
		if w := strings.Fields(s.Text()); len(w) == 2 && w[0] == "nameserver" {
			ns = append(ns, w[1])
		}
	}
	return ns
}
