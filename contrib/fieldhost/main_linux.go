// Command fieldhost boots the field-host VM (issue 24): a Debian guest
// with systemd as PID 1 on cgroup v2 alone, built and cached by
// internal/image, and runs kiln's suites in it, as root and as an ordinary
// user in a systemd session, the way runc's CI runs its suite in a VM. It
// is `make fieldhost-test`.
//
// The suites' binaries are built here (static, CGO_ENABLED=0) and put on a
// second disk with the guest's runner (guest/run), which a unit in the
// guest starts at boot; each suite's exit code, time and log come back on
// that disk, read with debugfs after the VM powers off. The serial console
// shows progress.
package main

import (
	"bufio"
	"context"
	"embed"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"kiln/internal/image"
)

//go:embed guest
var guestFiles embed.FS

// scale stretches the suites' timeouts: Python starts about 13 times
// slower under TCG than on the host.
const scale = 10

// suite is one line of the guest's suites file: a command run as user
// (root, or image.FieldHostUser in its systemd session) for at most
// timeout.
type suite struct {
	name    string
	user    string
	timeout time.Duration
	cmd     string
}

// jailTest runs the jail package's tests matching run, with the
// prebuilt kiln binaries and TCG's scale.
func jailTest(run string, timeout time.Duration) string {
	return fmt.Sprintf("KILN_TEST_BIN_DIR=%s/bin KILN_TEST_TIMEOUT_SCALE=%d ./jail.test -test.v -test.count=1 -test.timeout=%s -test.run '%s'",
		image.FieldHostTestDir, scale, timeout-30*time.Second, run)
}

// noSkip fails cmd, a go test binary's run, when a top-level test
// skipped: a suite that skips proves nothing.
func noSkip(cmd string) string {
	return `out=$(mktemp); set -o pipefail; ` + cmd + ` 2>&1 | tee "$out"; rc=$?; ` +
		`if grep -q -- '^--- SKIP' "$out"; then echo "fieldhost: a test skipped: counted as a failure"; rc=3; fi; exit $rc`
}

// suites are what `make fieldhost-test` runs, in order (the short ones
// first); -suites picks some.
var suites = []suite{
	{"cgroup-limits", "root", 6 * time.Minute, noSkip(jailTest("^(TestKillsNameTheLimit|TestAllBoxesLimit|TestCPULimit)$", 6*time.Minute))},
	{"orphan-sweep", "root", 5 * time.Minute, noSkip(jailTest("^(TestServerKilled|TestOrphanedMountPointWithSpace)$", 5*time.Minute))},
	{"systemd-unit", "root", 5 * time.Minute, "./systemd-unit"},
	// The rootless hook: the same battery as the ordinary user, in a
	// transient unit of the user's systemd manager.
	{"rootless-conformance", image.FieldHostUser, 10 * time.Minute,
		`echo "as $(id -un), in $(cat /proc/self/cgroup), delegated: $(cat /sys/fs/cgroup$(cut -d: -f3 /proc/self/cgroup)/cgroup.controllers)"; ` +
			noSkip(jailTest("^TestConformance$", 10*time.Minute))},
	{"jail-conformance", "root", 14 * time.Minute, noSkip(jailTest("^TestConformance$", 14*time.Minute))},
}

// expectedToFail names the suites that fail until the work they test
// lands, and why. Their result is reported but does not fail the run; one
// that passes is reported so it can be taken off this list.
var expectedToFail = map[string]string{}

func main() {
	buildOnly := flag.Bool("build-only", false, "build (or find) the field host image, print its directory and exit")
	only := flag.String("suites", "", "comma-separated suites to run (default: all of "+names()+")")
	out := flag.String("out", "bin/fieldhost", "directory for the suites' logs and the console log")
	accel := flag.String("accel", "auto", "QEMU accelerator: auto (KVM where a guest boots under it, else TCG), kvm or tcg")
	mem := flag.Int("memory", 3072, "guest memory, MiB")
	cpus := flag.Int("cpus", 2, "guest CPUs")
	flag.Parse()
	log := slog.New(slog.NewTextHandler(os.Stderr, nil))
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, log, *buildOnly, *only, *out, *accel, *mem, *cpus); err != nil {
		log.Error("fieldhost", "err", err)
		os.Exit(1)
	}
}

func names() string {
	var n []string
	for _, s := range suites {
		n = append(n, s.name)
	}
	return strings.Join(n, ",")
}

func run(ctx context.Context, log *slog.Logger, buildOnly bool, only, out, accel string, mem, cpus int) error {
	picked := suites
	if only != "" {
		picked = nil
		for _, n := range strings.Split(only, ",") {
			i := slices.IndexFunc(suites, func(s suite) bool { return s.name == n })
			if i < 0 {
				return fmt.Errorf("no suite %q (have %s)", n, names())
			}
			picked = append(picked, suites[i])
		}
	}
	start := time.Now()
	fh, err := image.BuildFieldHost(ctx, image.FieldHostOptions{Logger: log})
	if err != nil {
		return err
	}
	if buildOnly {
		fmt.Println(fh.Dir)
		return nil
	}
	log.Info("field host ready", "dir", fh.Dir, "kernel", fh.KernelVersion, "took", time.Since(start).Round(time.Second))
	work, err := os.MkdirTemp("", "kiln-fieldhost-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(work)
	root := filepath.Join(work, "disk")
	if err := buildTests(ctx, log, root); err != nil {
		return fmt.Errorf("building the suites: %w", err)
	}
	if accel == "auto" {
		var why string
		accel, why = probeAccel(ctx, fh)
		log.Info("accelerator", "accel", accel, "why", why)
	}
	res := filepath.Join(out, "results")
	os.RemoveAll(res)
	if err := os.MkdirAll(res, 0o755); err != nil {
		return err
	}
	// A guest that hangs (its runner silent, or a suite its timeout does
	// not end) is booted once more for the suites it did not finish: the
	// hang is printed, with the console's tail, and a suite that hangs
	// again fails the run.
	todo := picked
	var bootErr error
	for attempt := 1; ; attempt++ {
		bootErr = bootOnce(ctx, log, fh, root, filepath.Join(work, fmt.Sprintf("tests-%d.ext4", attempt)), accel, mem, cpus, todo, out, res)
		if !errors.Is(bootErr, errHung) || attempt == 2 {
			break
		}
		todo = slices.DeleteFunc(slices.Clone(todo), func(s suite) bool {
			_, err := os.Stat(filepath.Join(res, s.name+".rc"))
			return err == nil
		})
		if len(todo) == 0 {
			break
		}
		log.Warn("the guest hung: booting a new one for the suites it did not finish", "hang", bootErr, "suites", len(todo))
	}
	return errors.Join(bootErr, report(log, res, picked, accel))
}

// bootOnce packs todo's suites on disk, boots the VM, and copies the
// results it left into res. The results are read whatever the VM's end:
// a suite that hung still leaves the others' results on the disk.
func bootOnce(ctx context.Context, log *slog.Logger, fh *image.FieldHost, root, disk, accel string, mem, cpus int, todo []suite, out, res string) error {
	if err := packTests(ctx, root, disk, todo); err != nil {
		return fmt.Errorf("making the test disk: %w", err)
	}
	var budget time.Duration
	for _, s := range todo {
		budget += s.timeout + 15*time.Second
	}
	budget += 10 * time.Minute // boot and power-off, under TCG
	bootStart := time.Now()
	console := filepath.Join(out, "console.log")
	bootErr := boot(ctx, log, fh, disk, accel, mem, cpus, budget, todo, console)
	log.Info("VM stopped", "took", time.Since(bootStart).Round(time.Second), "err", bootErr)
	if bootErr != nil {
		// CI keeps only this output: what the guest said last.
		tail(console, 80)
	}
	dump := filepath.Join(filepath.Dir(disk), strings.TrimSuffix(filepath.Base(disk), ".ext4"))
	if err := os.MkdirAll(dump, 0o755); err != nil {
		return err
	}
	if err := exec.CommandContext(context.WithoutCancel(ctx), "debugfs", "-R", "rdump /results "+dump, disk).Run(); err != nil {
		return errors.Join(bootErr, fmt.Errorf("reading the results from the test disk: %w", err))
	}
	files, err := os.ReadDir(filepath.Join(dump, "results"))
	if err != nil {
		return errors.Join(bootErr, err)
	}
	for _, f := range files {
		if err := os.Rename(filepath.Join(dump, "results", f.Name()), filepath.Join(res, f.Name())); err != nil {
			return errors.Join(bootErr, err)
		}
	}
	return bootErr
}

// buildTests builds the suites' binaries into root, static.
func buildTests(ctx context.Context, log *slog.Logger, root string) error {
	if err := os.MkdirAll(filepath.Join(root, "bin"), 0o755); err != nil {
		return err
	}
	env := append(os.Environ(), "CGO_ENABLED=0")
	for _, c := range [][]string{
		{"go", "build", "-o", filepath.Join(root, "bin") + "/", "./cmd/kiln", "./cmd/kiln-agent"},
		{"go", "test", "-c", "-o", filepath.Join(root, "jail.test"), "./internal/sandbox/jail"},
	} {
		t := time.Now()
		cmd := exec.CommandContext(ctx, c[0], c[1:]...)
		cmd.Env, cmd.Stdout, cmd.Stderr = env, os.Stderr, os.Stderr
		if err := cmd.Run(); err != nil {
			return fmt.Errorf("running %s: %w", strings.Join(c, " "), err)
		}
		log.Info("built", "cmd", strings.Join(c[:3], " "), "took", time.Since(t).Round(time.Millisecond))
	}
	return nil
}

// packTests packs root's binaries, the guest's scripts, the systemd unit
// and a suites file of picked into an ext4 image labelled
// image.FieldHostTestLabel, with room for results.
func packTests(ctx context.Context, root, disk string, picked []suite) error {
	for _, name := range []string{"run", "systemd-unit"} {
		b, err := guestFiles.ReadFile("guest/" + name)
		if err != nil {
			return err
		}
		if err := os.WriteFile(filepath.Join(root, name), b, 0o755); err != nil {
			return err
		}
	}
	unit, err := os.ReadFile("contrib/systemd/kiln.service")
	if err != nil {
		return fmt.Errorf("reading the unit (run from the repository's root): %w", err)
	}
	if err := os.WriteFile(filepath.Join(root, "kiln.service"), unit, 0o644); err != nil {
		return err
	}
	var list strings.Builder
	for _, s := range picked {
		fmt.Fprintf(&list, "%s\t%s\t%d\t%s\n", s.name, s.user, int(s.timeout.Seconds()), s.cmd)
	}
	if err := os.WriteFile(filepath.Join(root, "suites"), []byte(list.String()), 0o644); err != nil {
		return err
	}
	// The results directory is written by root's runner; the user's
	// suite's output reaches it through the runner's redirection.
	if err := os.RemoveAll(filepath.Join(root, "results")); err != nil {
		return err
	}
	if err := os.Mkdir(filepath.Join(root, "results"), 0o755); err != nil {
		return err
	}
	var size int64
	filepath.Walk(root, func(_ string, fi os.FileInfo, err error) error {
		if err == nil && fi.Mode().IsRegular() {
			size += fi.Size()
		}
		return nil
	})
	f, err := os.Create(disk)
	if err != nil {
		return err
	}
	err = f.Truncate(size + 1<<30)
	f.Close()
	if err != nil {
		return err
	}
	if out, err := exec.CommandContext(ctx, "mkfs.ext4", "-q", "-F", "-L", image.FieldHostTestLabel, "-m", "0",
		"-E", "root_owner=0:0", "-d", root, disk).CombinedOutput(); err != nil {
		return fmt.Errorf("running mkfs.ext4: %w\n%s", err, out)
	}
	return nil
}

// probeAccel picks KVM only where a guest really boots under it: /dev/kvm
// opens, and the field host's kernel gets to the end of its boot (it
// panics for want of a root disk) within 30 s. A /dev/kvm that opens but
// boots no stock kernel (PVM) falls back to TCG.
func probeAccel(ctx context.Context, fh *image.FieldHost) (accel, why string) {
	f, err := os.OpenFile("/dev/kvm", os.O_RDWR, 0)
	if err != nil {
		return "tcg", fmt.Sprintf("no usable /dev/kvm (%v): software emulation (TCG)", err)
	}
	f.Close()
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	out, _ := exec.CommandContext(ctx, "qemu-system-x86_64", "-machine", "q35,accel=kvm", "-cpu", "host", "-m", "512",
		"-display", "none", "-no-reboot", "-nic", "none", "-serial", "stdio", "-monitor", "none",
		"-kernel", fh.KernelPath(), "-append", "console=ttyS0 panic=-1 root=/dev/nonexistent").CombinedOutput()
	if strings.Contains(string(out), "Kernel panic") || strings.Contains(string(out), "VFS:") {
		return "kvm", "a Debian kernel booted under /dev/kvm"
	}
	last := strings.TrimSpace(string(out))
	if i := strings.LastIndexByte(last, '\n'); i >= 0 {
		last = last[i+1:]
	}
	return "tcg", fmt.Sprintf("/dev/kvm opens but a stock Debian kernel does not boot under it within 30 s (a PVM host?; QEMU said %q): software emulation (TCG)", last)
}

// boot runs the VM until it powers off, copying its console to console
// and its "fieldhost:" lines to the log.
func boot(ctx context.Context, log *slog.Logger, fh *image.FieldHost, disk, accel string, mem, cpus int, budget time.Duration, picked []suite, console string) error {
	cpu := "max"
	if accel == "kvm" {
		cpu = "host"
	}
	ctx, cancel := context.WithTimeout(ctx, budget)
	defer cancel()
	ctx, hung := context.WithCancelCause(ctx)
	defer hung(nil)
	dog := newWatchdog(picked)
	go dog.watch(ctx, hung)
	args := []string{
		"-machine", "q35,accel=" + accel, "-cpu", cpu, "-smp", strconv.Itoa(cpus), "-m", strconv.Itoa(mem),
		"-display", "none", "-no-reboot", "-nic", "none", "-monitor", "none", "-serial", "stdio",
		"-device", "virtio-rng-pci",
		"-kernel", fh.KernelPath(), "-initrd", fh.InitrdPath(), "-append", fh.Cmdline,
		"-drive", "file=" + fh.RootfsPath() + ",format=raw,if=virtio,snapshot=on",
		"-drive", "file=" + disk + ",format=raw,if=virtio",
	}
	cmd := exec.CommandContext(ctx, "qemu-system-x86_64", args...)
	cmd.WaitDelay = 10 * time.Second
	cons, err := os.Create(console)
	if err != nil {
		return err
	}
	defer cons.Close()
	pr, pw := io.Pipe()
	cmd.Stdout, cmd.Stderr = pw, pw
	log.Info("booting", "accel", accel, "cpus", cpus, "memory_mib", mem, "budget", budget, "console", console)
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("starting qemu: %w", err)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		sc := bufio.NewScanner(pr)
		sc.Buffer(make([]byte, 64<<10), 1<<20)
		for sc.Scan() {
			line := sc.Text()
			fmt.Fprintln(cons, line)
			if i := strings.Index(line, "fieldhost: "); i >= 0 {
				fmt.Fprintln(os.Stderr, line[i:])
				dog.heard(line[i+len("fieldhost: "):], time.Now())
			}
		}
		io.Copy(io.Discard, pr)
	}()
	err = cmd.Wait()
	pw.Close()
	<-done
	if cause := context.Cause(ctx); errors.Is(cause, errHung) {
		return fmt.Errorf("%w (console: %s)", cause, console)
	}
	if ctx.Err() != nil {
		return fmt.Errorf("the VM ran past its budget of %s (console: %s)", budget, console)
	}
	if err != nil {
		return fmt.Errorf("running qemu: %w (console: %s)", err, console)
	}
	return nil
}

// report prints each suite's outcome and time, and fails unless every
// suite passed or is expected to fail.
func report(log *slog.Logger, res string, picked []suite, accel string) error {
	if facts, err := os.ReadFile(filepath.Join(res, "facts")); err == nil {
		fmt.Fprintf(os.Stderr, "fieldhost: the guest (%s):\n%s", accel, facts)
	}
	if _, err := os.Stat(filepath.Join(res, "done")); err != nil {
		log.Warn("the guest's runner did not finish")
	}
	var failed []string
	for _, s := range picked {
		rcb, err := os.ReadFile(filepath.Join(res, s.name+".rc"))
		if err != nil {
			if _, err := os.Stat(filepath.Join(res, s.name+".log")); err == nil {
				// Started and never ended: where it stopped.
				tail(filepath.Join(res, s.name+".log"), 60)
				fmt.Fprintf(os.Stderr, "fieldhost: %-22s NOT FINISHED\n", s.name)
				failed = append(failed, s.name)
				continue
			}
			fmt.Fprintf(os.Stderr, "fieldhost: %-22s NOT RUN\n", s.name)
			failed = append(failed, s.name)
			continue
		}
		rc, _ := strconv.Atoi(strings.TrimSpace(string(rcb)))
		tb, _ := os.ReadFile(filepath.Join(res, s.name+".time"))
		took := strings.TrimSpace(string(tb))
		why, expected := expectedToFail[s.name]
		verdict := "PASS"
		switch {
		case rc == 0 && expected:
			verdict = "PASS (listed in expectedToFail: take it off)"
		case rc != 0 && expected:
			verdict = "EXPECTED FAIL (" + why + ")"
		case rc != 0:
			verdict = "FAIL"
			failed = append(failed, s.name)
			tail(filepath.Join(res, s.name+".log"), 40)
		}
		fmt.Fprintf(os.Stderr, "fieldhost: %-22s %s, exit %d, %s s (log: %s)\n", s.name, verdict, rc, took, filepath.Join(res, s.name+".log"))
	}
	if len(failed) > 0 {
		return errors.New("suites failed: " + strings.Join(failed, ", "))
	}
	return nil
}

func tail(path string, n int) {
	b, err := os.ReadFile(path)
	if err != nil {
		return
	}
	lines := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	fmt.Fprintf(os.Stderr, "--- %s (last %d lines)\n%s\n---\n", path, len(lines), strings.Join(lines, "\n"))
}

// errHung is the watchdog's verdict: the guest stopped answering.
var errHung = errors.New("the guest hung")

// Watchdog limits: the guest's runner says something at least every
// heartbeat (guest/run), and a suite's timeout kills it within grace.
const (
	heartbeat = time.Minute
	silence   = 5 * heartbeat
	grace     = 3 * time.Minute
)

// watchdog stops a VM whose guest hangs, long before the whole budget: a
// console silent for silence once the runner has spoken, or a suite that
// outlives its timeout by grace (its processes would not die). Either way
// the guest is stuck, and waiting on gains nothing but CI time.
type watchdog struct {
	timeouts map[string]time.Duration

	mu      sync.Mutex
	last    time.Time // the runner's last line; zero before its first
	suite   string    // the suite running, if any
	started time.Time
}

func newWatchdog(picked []suite) *watchdog {
	d := &watchdog{timeouts: map[string]time.Duration{}}
	for _, s := range picked {
		d.timeouts[s.name] = s.timeout
	}
	return d
}

// heard takes one of the runner's lines (without its "fieldhost: ").
func (d *watchdog) heard(line string, now time.Time) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.last = now
	rest, ok := strings.CutPrefix(line, "suite ")
	if !ok {
		return
	}
	name, how, _ := strings.Cut(rest, " ")
	switch {
	case strings.HasSuffix(how, ": started"):
		d.suite, d.started = name, now
	case strings.HasPrefix(how, "exit "):
		d.suite = ""
	}
}

// verdict is why the guest counts as hung at now, or "".
func (d *watchdog) verdict(now time.Time) string {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.last.IsZero() {
		return ""
	}
	if quiet := now.Sub(d.last); quiet > silence {
		return fmt.Sprintf("its runner said nothing for %s (it speaks every %s)", quiet.Round(time.Second), heartbeat)
	}
	if d.suite != "" {
		if ran, tmo := now.Sub(d.started), d.timeouts[d.suite]; tmo > 0 && ran > tmo+grace {
			return fmt.Sprintf("suite %s ran %s, past its timeout of %s and %s more for its kill", d.suite, ran.Round(time.Second), tmo, grace)
		}
	}
	return ""
}

func (d *watchdog) watch(ctx context.Context, hung context.CancelCauseFunc) {
	t := time.NewTicker(10 * time.Second)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case now := <-t.C:
			if why := d.verdict(now); why != "" {
				hung(fmt.Errorf("%w: %s", errHung, why))
				return
			}
		}
	}
}
