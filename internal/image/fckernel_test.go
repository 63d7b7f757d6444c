package image_test

import (
	"context"
	"debug/elf"
	"log/slog"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	"kiln/internal/image"
)

// firecrackerNeeds is what the Firecracker driver and the guest's init
// need of the kernel, and why; FirecrackerKernelConfig must have each.
var firecrackerNeeds = []struct {
	image.KernelOption
	why string
}{
	{image.KernelOption{Name: "64BIT", Value: "y"}, "the x86-64 guest"},
	{image.KernelOption{Name: "VIRTIO_MMIO", Value: "y"}, "Firecracker's only transport"},
	{image.KernelOption{Name: "VIRTIO_MMIO_CMDLINE_DEVICES", Value: "y"}, "Firecracker declares devices on the command line"},
	{image.KernelOption{Name: "VIRTIO_BLK", Value: "y"}, "root=/dev/vda"},
	{image.KernelOption{Name: "EXT4_FS", Value: "y"}, "rootfstype=ext4"},
	{image.KernelOption{Name: "VSOCKETS", Value: "y"}, "kiln.transport=vsock"},
	{image.KernelOption{Name: "VIRTIO_VSOCKETS", Value: "y"}, "Firecracker's vsock device"},
	{image.KernelOption{Name: "SERIAL_8250_CONSOLE", Value: "y"}, "console=ttyS0"},
	{image.KernelOption{Name: "HW_RANDOM_VIRTIO", Value: "y"}, "the driver's entropy device"},
	{image.KernelOption{Name: "MODULES", Value: "n"}, "no initramfs: everything built in; modules_disabled"},
	{image.KernelOption{Name: "PCI", Value: "n"}, "Firecracker has no PCI"},
	{image.KernelOption{Name: "DEVTMPFS", Value: "y"}, "guestinit mounts devtmpfs on /dev"},
	{image.KernelOption{Name: "UNIX98_PTYS", Value: "y"}, "guestinit's pty bridge and devpts"},
	{image.KernelOption{Name: "TMPFS", Value: "y"}, "guestinit's /tmp, /run, /dev/shm and workspace"},
	{image.KernelOption{Name: "PROC_FS", Value: "y"}, "guestinit mounts /proc"},
	{image.KernelOption{Name: "PROC_SYSCTL", Value: "y"}, "guestinit's hardening sysctls"},
	{image.KernelOption{Name: "SYSFS", Value: "y"}, "guestinit mounts /sys"},
	{image.KernelOption{Name: "INET", Value: "y"}, "guestinit brings up lo"},
	{image.KernelOption{Name: "CGROUPS", Value: "y"}, "guestinit's code cgroup"},
	{image.KernelOption{Name: "MEMCG", Value: "y"}, "memory.max on the code cgroup"},
	{image.KernelOption{Name: "SWAP", Value: "y"}, "memory.swap.max exists only with swap"},
	{image.KernelOption{Name: "CGROUP_PIDS", Value: "y"}, "pids.max on the code cgroup"},
	{image.KernelOption{Name: "MULTIUSER", Value: "y"}, "code runs as an unprivileged user"},
	{image.KernelOption{Name: "FUTEX", Value: "y"}, "glibc threads"},
	{image.KernelOption{Name: "EPOLL", Value: "y"}, "the Go runtime of kiln-agent"},
	{image.KernelOption{Name: "BINFMT_ELF", Value: "y"}, "running anything"},
	{image.KernelOption{Name: "BINFMT_SCRIPT", Value: "y"}, "#! scripts"},
	{image.KernelOption{Name: "USER_NS", Value: "n"}, "no user namespaces in the box"},
}

func TestFirecrackerKernelConfig(t *testing.T) {
	have := map[string]string{}
	for _, o := range image.FirecrackerKernelConfig {
		if strings.HasPrefix(o.Name, "CONFIG_") || o.Name == "" || o.Value == "" {
			t.Errorf("malformed option %+v", o)
		}
		if _, dup := have[o.Name]; dup {
			t.Errorf("option %s listed twice", o.Name)
		}
		have[o.Name] = o.Value
	}
	for _, n := range firecrackerNeeds {
		if got := have[n.Name]; got != n.Value {
			t.Errorf("FirecrackerKernelConfig has %s=%q, want %q (%s)", n.Name, got, n.Value, n.why)
		}
	}
}

func TestCheckKernelConfig(t *testing.T) {
	const dotconfig = `#
# Automatically generated file; DO NOT EDIT.
CONFIG_64BIT=y
CONFIG_VIRTIO_MMIO=y
# CONFIG_PCI is not set
CONFIG_NR_CPUS=64
CONFIG_CMDLINE=""
`
	opt := func(name, value string) image.KernelOption { return image.KernelOption{Name: name, Value: value} }
	tests := []struct {
		name    string
		want    []image.KernelOption
		wantErr string
	}{
		{"all there", []image.KernelOption{opt("64BIT", "y"), opt("VIRTIO_MMIO", "y"), opt("NR_CPUS", "64")}, ""},
		{"not set is n", []image.KernelOption{opt("PCI", "n")}, ""},
		{"absent is n", []image.KernelOption{opt("ACPI", "n")}, ""},
		{"empty string", []image.KernelOption{opt("CMDLINE", `""`)}, ""},
		{"dropped", []image.KernelOption{opt("VIRTIO_BLK", "y")}, "VIRTIO_BLK=n (want y)"},
		{"not off", []image.KernelOption{opt("64BIT", "n")}, "64BIT=y (want n)"},
		{"wrong value", []image.KernelOption{opt("NR_CPUS", "8")}, "NR_CPUS=64 (want 8)"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := image.CheckKernelConfig(dotconfig, tt.want)
			switch {
			case tt.wantErr == "" && err != nil:
				t.Errorf("unexpected error: %v", err)
			case tt.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tt.wantErr)):
				t.Errorf("error = %v, want one mentioning %q", err, tt.wantErr)
			}
		})
	}
}

// TestBuildFirecrackerKernel builds the kernel from linux-source (many
// minutes on two cores; cached in ~/.cache/kiln/images) and checks that it
// is an x86-64 ELF with the options the driver needs, and that building
// again with the same inputs is a no-op. Not in CI: too slow.
func TestBuildFirecrackerKernel(t *testing.T) {
	if os.Getenv("KILN_FCKERNEL_TEST") != "1" {
		t.Skip("set KILN_FCKERNEL_TEST=1 to build the Firecracker kernel (needs linux-source-6.1 and a kernel toolchain)")
	}
	if runtime.GOOS != "linux" || runtime.GOARCH != "amd64" {
		t.Skip("the Firecracker kernel builds on linux/amd64 only")
	}
	ctx := context.Background()
	log := slog.New(slog.NewTextHandler(testWriter{t}, nil))
	path, err := image.BuildFirecrackerKernel(ctx, image.KernelOptions{Logger: log})
	if err != nil {
		t.Fatal(err)
	}
	f, err := elf.Open(path)
	if err != nil {
		t.Fatalf("vmlinux is not an ELF: %v", err)
	}
	if f.Class != elf.ELFCLASS64 || f.Machine != elf.EM_X86_64 || f.Type != elf.ET_EXEC {
		t.Errorf("vmlinux is %v %v %v, want an x86-64 executable", f.Class, f.Machine, f.Type)
	}
	f.Close()
	cfg, err := os.ReadFile(filepath.Join(filepath.Dir(path), "config"))
	if err != nil {
		t.Fatal(err)
	}
	if err := image.CheckKernelConfig(string(cfg), image.FirecrackerKernelConfig); err != nil {
		t.Error(err)
	}
	for _, n := range firecrackerNeeds {
		if err := image.CheckKernelConfig(string(cfg), []image.KernelOption{n.KernelOption}); err != nil {
			t.Errorf("%v (%s)", err, n.why)
		}
	}
	before, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	again, err := image.BuildFirecrackerKernel(ctx, image.KernelOptions{Logger: log})
	if err != nil {
		t.Fatal(err)
	}
	after, err := os.Stat(again)
	if err != nil {
		t.Fatal(err)
	}
	if again != path || !after.ModTime().Equal(before.ModTime()) {
		t.Errorf("rebuild with the same inputs was not a no-op: %s → %s", path, again)
	}
	t.Logf("cached lookup took %v", time.Since(start).Round(time.Millisecond))
}

type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimSpace(string(p)))
	return len(p), nil
}
