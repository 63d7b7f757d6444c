//go:build !linux

// Command fieldhost boots the field-host VM; it runs on Linux only.
package main

import (
	"fmt"
	"os"
)

func main() {
	fmt.Fprintln(os.Stderr, "fieldhost: the field-host VM is built and booted on Linux only")
	os.Exit(1)
}
