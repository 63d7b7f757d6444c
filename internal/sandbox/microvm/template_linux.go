package microvm

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"

	"kiln/internal/guestinit"
)

// A configured template (Options.Template, kiln template) is a host
// directory of plain files. The microVM cannot share a host directory
// without a file server in the VMM, so the backend packs the files into
// a read-only ext4 image (mkfs.ext4 -d, as the guest image's root), kept
// in StateDir under a name that hashes the files' tree (paths, modes,
// sizes, times): a template made again gets a new image. Every VM, the
// saved one and each clone, has it as a second virtio-blk disk opened
// read-only by QEMU; the guest's init mounts it at boxpolicy.TemplateDir
// read-only, nosuid and nodev, and puts its python directory on
// PYTHONPATH. The image's path is part of the VM's config, so of the
// saved VM's key: the template's --import modules (in the preload) are
// imported before the VM is saved, and a clone never meets another
// template's files. Writes fail in the guest (read-only mount of a
// read-only disk) and cannot reach the host: QEMU opens the image
// read-only and the host's template directory is never given to it.

// templateImage returns the ext4 image of the template directory dir,
// making it in stateDir if needed.
func templateImage(ctx context.Context, stateDir, dir string) (string, error) {
	if !filepath.IsAbs(dir) {
		return "", fmt.Errorf("microvm backend: template directory %q is not an absolute path", dir)
	}
	st, err := os.Stat(dir)
	if err != nil {
		return "", fmt.Errorf("microvm backend: template directory: %w", err)
	}
	if !st.IsDir() {
		return "", fmt.Errorf("microvm backend: template directory %s is not a directory", dir)
	}
	h := sha256.New()
	var size, files int64
	err = filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		fi, err := d.Info()
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(dir, p)
		fmt.Fprintf(h, "%q %o %d %d\n", rel, fi.Mode(), fi.Size(), fi.ModTime().UnixNano())
		files++
		if fi.Mode().IsRegular() {
			size += (fi.Size() + 4095) &^ 4095
		}
		return nil
	})
	if err != nil {
		return "", fmt.Errorf("microvm backend: reading template: %w", err)
	}
	out := filepath.Join(stateDir, "tplfs-"+hex.EncodeToString(h.Sum(nil))[:16]+".ext4")
	if _, err := os.Stat(out); err == nil {
		return out, nil
	}
	tmp := out + ".tmp-" + randomID()
	defer os.Remove(tmp)
	total := (size+files*512)*6/5 + 8<<20
	total = (total + 1<<20 - 1) &^ (1<<20 - 1)
	f, err := os.OpenFile(tmp, os.O_CREATE|os.O_WRONLY|os.O_EXCL, 0o644)
	if err != nil {
		return "", err
	}
	err = f.Truncate(total)
	f.Close()
	if err != nil {
		return "", err
	}
	cmd := exec.CommandContext(ctx, "mkfs.ext4", "-q", "-F", "-L", guestinit.TemplateLabel, "-O", "^has_journal", "-m", "0",
		"-N", fmt.Sprint(files*3/2+256), "-d", dir, tmp)
	if b, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("microvm backend: packing template files (mkfs.ext4): %w: %s", err, strings.TrimSpace(string(b)))
	}
	if err := os.Rename(tmp, out); err != nil {
		return "", err
	}
	return out, nil
}

// templateDisk is the guest device of the template image: the second
// virtio-blk disk.
const templateDisk = "/dev/vdb"
