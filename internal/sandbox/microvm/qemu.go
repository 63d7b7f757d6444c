package microvm

import (
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"

	"kiln/internal/boxpolicy"
	"kiln/internal/guestinit"
	"kiln/internal/sandbox"
)

// File descriptors the QEMU child inherits (exec.Cmd.ExtraFiles start at 3).
const (
	fdAgent = 3 // our end of a socketpair: the agent's virtio-serial port
	fdQMP   = 4 // our end of a socketpair: QMP
	fdSeed  = 5 // our end of a socketpair: entropy for a restored clone
	fdState = 6 // the migration stream read by a clone
	fdMem   = 7 // the guest RAM memfd of a template and its clones
	fdTap   = 8 // the tap of a VM with a network (egress.VMAttachment.Tap)
)

// guestMAC is every guest's MAC: each VM is alone on its link (its own
// bridge and veth to the gateway), so one address serves them all, and a
// clone's matches its template's.
const guestMAC = "02:6b:69:6c:6e:01"

// memFDPath is where QEMU opens the guest RAM: the inherited memfd.
var memFDPath = fmt.Sprintf("/proc/self/fd/%d", fdMem)

// vmConfig is everything that shapes one QEMU command line. Template and
// clones of it must agree on everything but MemShared and Incoming, or the
// migration stream will not load.
type vmConfig struct {
	QEMU      string
	Accel     string // "kvm" or "tcg"
	MemoryMiB int64
	CPUs      int
	Kernel    string
	Initrd    string
	Rootfs    string
	Template  string // read-only ext4 image of a configured template's files; "": none
	Cmdline   string
	Plan      string // digest of the box plan on Cmdline, which the guest's hello names
	MemFile   string // guest RAM file (memFDPath); "" for anonymous RAM (cold boot)
	MemShared bool   // share=on: a template writes its RAM to MemFile
	Incoming  bool   // -incoming defer: a clone waits for its state
	Console   string // file that receives the guest console
	Seccomp   bool   // -sandbox on with the dangerous groups denied
	Net       bool   // a virtio-net device on the tap at fdTap
}

// args returns QEMU's arguments. The machine is QEMU's microvm: no PCI, no
// firmware, virtio-mmio devices found through ACPI; no network device
// unless Net, and then one on the tap kiln opened (QEMU opens nothing).
func (c vmConfig) args() []string {
	cpu := "max"
	accel := "tcg,tb-size=256"
	if c.Accel == "kvm" {
		cpu, accel = "host", "kvm"
	}
	a := []string{
		"-nodefaults", "-no-user-config", "-nographic", "-no-reboot",
		"-machine", "microvm,acpi=on,rtc=on,isa-serial=on",
		"-accel", accel,
		"-cpu", cpu,
		"-smp", fmt.Sprint(c.CPUs),
		"-m", fmt.Sprintf("%dM", c.MemoryMiB),
		"-kernel", c.Kernel,
		"-initrd", c.Initrd,
		"-append", c.Cmdline,
		"-drive", "id=root,if=none,format=raw,readonly=on,file=" + escapeOpt(c.Rootfs),
		"-device", "virtio-blk-device,drive=root",
	}
	if c.Template != "" {
		a = append(a, "-drive", "id=tpl,if=none,format=raw,readonly=on,file="+escapeOpt(c.Template),
			"-device", "virtio-blk-device,drive=tpl")
	}
	if c.Net {
		a = append(a, "-netdev", fmt.Sprintf("tap,id=net0,fd=%d,vhost=off", fdTap),
			"-device", "virtio-net-device,netdev=net0,mac="+guestMAC)
	}
	a = append(a,
		"-device", "virtio-serial-device,max_ports=4",
		"-chardev", fmt.Sprintf("socket,id=agent,fd=%d", fdAgent),
		"-device", "virtserialport,chardev=agent,name="+guestinit.PortName,
		"-chardev", fmt.Sprintf("socket,id=seed,fd=%d", fdSeed),
		"-device", "virtserialport,chardev=seed,name="+guestinit.SeedPortName,
		"-device", "virtio-rng-device",
		"-chardev", fmt.Sprintf("socket,id=qmp,fd=%d", fdQMP),
		"-mon", "chardev=qmp,mode=control",
	)
	if c.Console != "" {
		a = append(a, "-chardev", "file,id=con,path="+escapeOpt(c.Console), "-serial", "chardev:con")
	} else {
		a = append(a, "-serial", "null")
	}
	if c.MemFile != "" {
		share := "off"
		if c.MemShared {
			share = "on"
		}
		a = append(a,
			"-object", fmt.Sprintf("memory-backend-file,id=ram,size=%dM,mem-path=%s,share=%s", c.MemoryMiB, escapeOpt(c.MemFile), share),
			"-machine", "memory-backend=ram")
	}
	if c.Incoming {
		a = append(a, "-incoming", "defer")
	}
	if c.Seccomp {
		a = append(a, "-sandbox", "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny")
	}
	return a
}

// escapeOpt doubles commas, QEMU's escape inside option values.
func escapeOpt(s string) string { return strings.ReplaceAll(s, ",", ",,") }

// guestUID is the unprivileged user that runs code in the guest (the image
// creates it).
const guestUID = boxpolicy.UID

// guestNet is the network every VM of a backend gets
// (egress.Gateway.VMNetwork); nil: none.
type guestNet struct {
	plan boxpolicy.Network
	env  []string
}

// guestPlan is the box plan of a guest with limits l and network n, as
// the jail and gVisor compute theirs, with the workspace the code's. It
// has no Landlock rules: the VM is the boundary, and the guest applies
// none.
func guestPlan(l sandbox.Limits, n *guestNet) boxpolicy.Plan {
	p := l.Plan(guestUID, guestUID)
	p.Landlock = nil
	if n != nil {
		nw := n.plan
		p.Network = &nw
		p.Env = append(slices.Clip(p.Env), n.env...)
	}
	return p
}

// kernelCmdline is the guest kernel's command line: the box plan for
// limits l and network n (guestPlan), the code's memory and the transport ("serial" or
// "vsock") of the agent's stream, as guestinit.Params, which guestinit
// reads back, and kiln-agent's flags after "--". tscKHz, when not zero, is given to the guest as
// tsc_early_khz: under TCG the guest's TSC runs at the host's rate, and
// calibrating it against the emulated PIT fails on a busy host and hangs
// the boot. extra are kernel parameters added before init's arguments.
func kernelCmdline(l sandbox.Limits, n *guestNet, preload []string, verbose bool, tscKHz int64, transport string, extra ...string) string {
	w := []string{
		"console=ttyS0", "ro", "panic=-1",
		"reboot=t", "tsc=reliable", "no_timer_check", "random.trust_cpu=on",
	}
	if tscKHz > 0 {
		w = append(w, fmt.Sprintf("tsc_early_khz=%d", tscKHz))
	}
	if !verbose {
		w = append(w, "quiet", "loglevel=3")
	}
	plan := guestPlan(l, n)
	p := guestinit.DefaultParams()
	p.Plan = &plan
	p.MemoryBytes = l.MemoryBytes
	p.Transport = transport
	w = append(w, p.Cmdline()...)
	w = append(w, extra...)
	w = append(w,
		"--", "-guest",
		fmt.Sprintf("-uid=%d", guestUID),
		fmt.Sprintf("-gid=%d", guestUID),
	)
	if len(preload) > 0 {
		w = append(w, "-preload="+strings.Join(preload, ","))
	}
	if verbose {
		w = append(w, "-v")
	}
	return strings.Join(w, " ")
}

// checkCmdline refuses a kernel command line the kernel would cut: the
// guest would boot without its box plan's end.
func checkCmdline(c string) error {
	if len(c) > guestinit.MaxCmdline {
		return fmt.Errorf("microvm: the guest's kernel command line is %d bytes, over the kernel's %d: fewer preloaded modules or egress secrets", len(c), guestinit.MaxCmdline)
	}
	return nil
}

// guestReserveMiB is guest RAM beyond the box's memory limit, for the
// guest kernel and the agent (which holds a whole protocol frame while it
// decodes it). The limit itself applies to the code, in the guest's code
// cgroup (guestinit.CodeCgroup).
const guestReserveMiB = 192

// guestShape turns limits into VM size: RAM in MiB (the limit, at least 64
// MiB, plus the reserve) and whole vCPUs.
func guestShape(l sandbox.Limits) (memMiB int64, cpus int) {
	memMiB = max(l.MemoryBytes>>20, 64) + guestReserveMiB
	cpus = max(int(math.Ceil(l.CPUs)), 1)
	return memMiB, cpus
}

// hostTSCKHz reads the host CPU's clock from /proc/cpuinfo ("cpu MHz"),
// which is the TSC rate on the hosts kiln's TCG mode is meant for. It
// returns 0 when it cannot tell.
func hostTSCKHz(cpuinfo string) int64 {
	for _, line := range strings.Split(cpuinfo, "\n") {
		k, v, ok := strings.Cut(line, ":")
		if !ok || strings.TrimSpace(k) != "cpu MHz" {
			continue
		}
		mhz, err := strconv.ParseFloat(strings.TrimSpace(v), 64)
		if err != nil || mhz <= 0 {
			return 0
		}
		return int64(mhz * 1000)
	}
	return 0
}
