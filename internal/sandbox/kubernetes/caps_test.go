package kubernetes

import (
	"context"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"

	"kiln/internal/agentproto"
	"kiln/internal/sandbox"
)

// TestAgentCapabilitiesNeeded runs a box without each of the agent's
// capabilities in turn and sees what breaks: without SETUID or SETGID the
// agent cannot start code as the box's uid (nothing runs), without KILL it
// cannot interrupt code. That no other capability is needed on runc
// (CHOWN, DAC_OVERRIDE, FOWNER: the file tools take code's file ids with
// setfsuid) is TestConformanceRunc, which passes with these three alone.
func TestAgentCapabilitiesNeeded(t *testing.T) {
	c := needCluster(t)
	c.runtimeClass(t, "runc")
	b := c.backend(t, c.namespace(t), Options{RuntimeClass: "runc"})
	all := agentCaps
	t.Cleanup(func() { agentCaps = all })
	for _, cp := range all {
		t.Run(string(cp), func(t *testing.T) {
			agentCaps = slices.DeleteFunc(slices.Clone(all), func(x corev1.Capability) bool { return x == cp })
			defer func() { agentCaps = all }()
			ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
			defer cancel()
			box, err := b.Create(ctx, sandbox.Spec{ID: "caps-" + strings.ToLower(string(cp))})
			agentCaps = all
			if err != nil {
				t.Logf("no box without %s: %v", cp, err)
				return
			}
			defer box.Close()
			perr := sandbox.Probe(ctx, box)
			switch cp {
			case "SETUID", "SETGID":
				if perr == nil {
					t.Errorf("without %s code still runs", cp)
				} else {
					t.Logf("without %s: %v", cp, perr)
				}
			case "KILL":
				if perr != nil {
					t.Fatalf("without KILL: %v", perr)
				}
				if interrupted(ctx, t, box) {
					t.Error("without KILL the agent still interrupts code")
				}
			default:
				t.Errorf("no check of %s", cp)
			}
		})
	}
	// With all three, the same interrupt works.
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	box, err := b.Create(ctx, sandbox.Spec{ID: "caps-all"})
	if err != nil {
		t.Fatal(err)
	}
	defer box.Close()
	if !interrupted(ctx, t, box) {
		t.Error("with KILL the agent does not interrupt code")
	}
	codeIdentity(ctx, t, box)
}

// codeIdentity checks what code runs as: the box's own uid and gid with no
// other group, no capability in any set but the bounding one, no way to
// regain one (no_new_privs), and under the one seccomp filter the runtime
// gave the agent (kiln's profile: the agent adds none of its own).
func codeIdentity(ctx context.Context, t *testing.T, box sandbox.Sandbox) {
	t.Helper()
	r, err := box.RunShell(ctx, `grep -E '^(Uid|Gid|Groups|CapInh|CapPrm|CapEff|CapAmb|NoNewPrivs|Seccomp|Seccomp_filters):' /proc/self/status; echo "agent $(grep -E '^(Uid|Seccomp_filters):' /proc/1/status | tr -s '\t' ' ' | tr '\n' ' ')"`, sandbox.ExecOptions{})
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]string{}
	for _, line := range strings.Split(strings.TrimSpace(r.Stdout.Text), "\n") {
		k, v, _ := strings.Cut(line, ":")
		got[k] = strings.Join(strings.Fields(v), " ")
	}
	uid := strings.Fields(got["Uid"])
	if len(uid) != 4 || uid[0] == "0" || strings.Count(got["Uid"], uid[0]) != 4 || got["Gid"] != got["Uid"] || got["Groups"] != "" {
		t.Errorf("code's ids: uid %q gid %q groups %q, want one non-root id for all and no group", got["Uid"], got["Gid"], got["Groups"])
	}
	for _, k := range []string{"CapInh", "CapPrm", "CapEff", "CapAmb"} {
		if got[k] != "0000000000000000" {
			t.Errorf("code's %s = %s", k, got[k])
		}
	}
	if got["NoNewPrivs"] != "1" || got["Seccomp"] != "2" || got["Seccomp_filters"] != "1" {
		t.Errorf("code: no_new_privs %s, seccomp mode %s with %s filters; want 1, 2 (filter), 1", got["NoNewPrivs"], got["Seccomp"], got["Seccomp_filters"])
	}
	if a := r.Stdout.Text[strings.LastIndex(r.Stdout.Text, "agent "):]; !strings.Contains(a, "Uid: 0 0 0 0") || !strings.Contains(a, "Seccomp_filters: 1") {
		t.Errorf("the agent (PID 1): %s, want root under the same one filter", a)
	}
	t.Logf("code: %v", got)
}

// interrupted runs a long shell command and interrupts it until it ends,
// for at most 30 s, and says whether it ended by the interrupt.
func interrupted(ctx context.Context, t *testing.T, box sandbox.Sandbox) bool {
	t.Helper()
	type result struct {
		r   *agentproto.ExecResult
		err error
	}
	done := make(chan result, 1)
	go func() {
		r, err := box.RunShell(ctx, "sleep 600", sandbox.ExecOptions{})
		done <- result{r, err}
	}()
	give := time.After(30 * time.Second)
	tick := time.NewTicker(300 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case res := <-done:
			if res.err != nil {
				t.Fatalf("sleep: %v", res.err)
			}
			return res.r.Interrupt || res.r.Signal != ""
		case <-tick.C:
			box.Interrupt(ctx)
		case <-give:
			return false
		}
	}
}
