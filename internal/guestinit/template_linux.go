package guestinit

import (
	"bytes"
	"fmt"
	"os"

	"golang.org/x/sys/unix"

	"kiln/internal/boxpolicy"
)

// mountTemplate mounts the template disk the command line names, if any,
// at boxpolicy.TemplateDir (the image has the directory). Stage 2 adds
// templateEnv to the agent's environment.
func mountTemplate(cmdline string) error {
	dev := templateDevice(cmdline)
	if dev == "" {
		return nil
	}
	if err := waitFor(dev); err != nil {
		return fmt.Errorf("template disk: %w", err)
	}
	label, err := ext4Label(dev)
	if err != nil {
		return fmt.Errorf("template disk: %w", err)
	}
	if label != TemplateLabel {
		return fmt.Errorf("template disk %s: label %q, want %q", dev, label, TemplateLabel)
	}
	flags := uintptr(unix.MS_RDONLY | unix.MS_NOSUID | unix.MS_NODEV)
	if err := unix.Mount(dev, boxpolicy.TemplateDir, "ext4", flags, ""); err != nil {
		return fmt.Errorf("mounting template disk %s on %s: %w", dev, boxpolicy.TemplateDir, err)
	}
	return nil
}

// ext4Label reads the volume name from dev's ext4 superblock.
func ext4Label(dev string) (string, error) {
	f, err := os.Open(dev)
	if err != nil {
		return "", err
	}
	defer f.Close()
	sb := make([]byte, 1024)
	if _, err := f.ReadAt(sb, 1024); err != nil {
		return "", err
	}
	if sb[0x38] != 0x53 || sb[0x39] != 0xef {
		return "", fmt.Errorf("%s is not ext4", dev)
	}
	name := sb[0x78 : 0x78+16]
	if i := bytes.IndexByte(name, 0); i >= 0 {
		name = name[:i]
	}
	return string(name), nil
}
