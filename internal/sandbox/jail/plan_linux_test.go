package jail_test

import (
	"context"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"kiln/internal/boxpolicy"
	"kiln/internal/sandbox"
)

// planProbe shows, from inside a box, what its plan made of it: the
// per-box mounts with their options (workspace, /tmp, /dev/shm, /proc/sys
// and the masks over /proc), the rlimits, the environment, /etc, and what
// Landlock lets code write. Only the topmost mount on each path counts (a
// forked box mounts over its template's); mount ids are left out, and
// lines are sorted, since the two paths mount in different orders.
const planProbe = `awk '$5 ~ /^\/(work|tmp|dev\/shm|proc|proc\/sys|proc\/(kcore|keys|timer_list|sysrq-trigger))$/ {
	sep = 0; for (i = 7; i <= NF; i++) if ($i == "-") sep = i
	top[$5] = "mount " $4 " " $5 " " $6 " " $(sep+1) " " $(sep+2) " " $(sep+3)
} END { for (m in top) print top[m] }' /proc/self/mountinfo
echo "rlimit core $(ulimit -c) nofile $(ulimit -n) nproc $(ulimit -u)"
echo "hostname $(hostname) pwd $(pwd) id $(id)"
env | grep -v -E '^(_|SHLVL|PWD|OLDPWD)=' | sed 's/^/env /'
for f in passwd group hosts hostname nsswitch.conf resolv.conf; do sed "s|^|etc $f |" /etc/$f; done
for d in /work /tmp /dev/shm /etc /usr /.kiln /proc; do
	(touch $d/planprobe && echo "write $d ok" && rm -f $d/planprobe) 2>/dev/null || echo "write $d refused"
done
for f in /dev/null /dev/zero; do (: > $f) 2>/dev/null && echo "write $f ok" || echo "write $f refused"; done
ls / | sed 's/^/root /'`

// TestDirectAndZygotePlansAgree starts a box directly (the jail's Go init
// interprets its plan) and one forked from a zygote template (zygote.py
// interprets the plan generated for it) with the same limits, and sees
// the same box from inside both: masks, mounts, tmpfs sizes and options,
// rlimits, environment, /etc and Landlock's writable paths.
func TestDirectAndZygotePlansAgree(t *testing.T) {
	direct, zygote := newBackend(t), newZygoteBackend(t)
	defer direct.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	lim := sandbox.Limits{WorkspaceBytes: 24 << 20, TmpBytes: 40 << 20, Inodes: 3000, Pids: 77, OpenFiles: 333}
	probe := func(b sandbox.Backend, id string) []string {
		box, err := b.Create(ctx, sandbox.Spec{ID: id, Limits: lim})
		if err != nil {
			t.Fatal(err)
		}
		defer box.Close()
		r, err := box.RunShell(ctx, planProbe, sandbox.ExecOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if r.ExitCode != 0 || r.Stderr.Text != "" {
			t.Fatalf("probe in %s: exit %d: %s", id, r.ExitCode, r.Stderr.Text)
		}
		lines := strings.Split(strings.TrimSpace(r.Stdout.Text), "\n")
		sort.Strings(lines)
		return lines
	}
	d, z := probe(direct, "plan-direct"), probe(zygote, "plan-zygote")
	for _, want := range []string{"rlimit core 0 nofile 333 nproc 77", "write /work ok", "write /etc refused"} {
		if !strings.Contains(strings.Join(d, "\n"), want) {
			t.Errorf("the direct box lacks %q:\n%s", want, strings.Join(d, "\n"))
		}
	}
	// The jail's /etc is the plan's, as gVisor's is (TestEtcFromPlan).
	for _, line := range strings.Split(strings.TrimSpace(boxpolicy.Etc(boxpolicy.Hostname, "", boxpolicy.UID, boxpolicy.GID)["passwd"]), "\n") {
		if !slices.Contains(d, "etc passwd "+line) {
			t.Errorf("the box's /etc/passwd lacks %q", line)
		}
	}
	if diff := cmp.Diff(d, z); diff != "" {
		t.Errorf("a direct box and a zygote box differ (-direct +zygote):\n%s", diff)
	}
}
