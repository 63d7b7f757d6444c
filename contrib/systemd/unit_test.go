// Package systemd holds kiln's systemd unit; its test checks the unit with
// systemd-analyze.
package systemd

import (
	"bufio"
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// verify runs systemd-analyze verify on a copy of unit whose ExecStart
// names an executable that exists here (the unit's /usr/local/bin/kiln
// need not), and returns what it reports: any line is a mistake, since
// systemd-analyze exits 0 on unknown keys and bad values.
func verify(t *testing.T, unit string) string {
	t.Helper()
	sa, err := exec.LookPath("systemd-analyze")
	if err != nil {
		t.Skip("systemd-analyze is not installed (Debian: apt-get install systemd); the unit is not checked")
	}
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	unit = strings.ReplaceAll(unit, "ExecStart=/usr/local/bin/kiln ", "ExecStart="+self+" ")
	p := filepath.Join(t.TempDir(), "kiln.service")
	if err := os.WriteFile(p, []byte(unit), 0o644); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(sa, "verify", p)
	cmd.Env = append(os.Environ(), "SYSTEMD_LOG_COLOR=0")
	out, err := cmd.CombinedOutput()
	if err != nil {
		return string(out) + err.Error()
	}
	return string(bytes.TrimSpace(out))
}

func TestUnitVerifies(t *testing.T) {
	unit, err := os.ReadFile("kiln.service")
	if err != nil {
		t.Fatal(err)
	}
	if got := verify(t, string(unit)); got != "" {
		t.Errorf("systemd-analyze verify kiln.service:\n%s", got)
	}
	// The check sees mistakes: a misspelt key and a bad value.
	bad := strings.Replace(string(unit), "ProtectSystem=strict", "ProtectSystem=strickt\nProtectSytem=strict", 1)
	if got := verify(t, bad); !strings.Contains(got, "strickt") || !strings.Contains(got, "ProtectSytem") {
		t.Errorf("systemd-analyze did not report the broken unit's mistakes:\n%s", got)
	}
}

// TestUnitLeavesKilnWorking: the unit keeps out the directives that stop
// kiln from making boxes (the unit's head says why for each), and starts
// kiln serve with the system configuration.
func TestUnitLeavesKilnWorking(t *testing.T) {
	f, err := os.Open("kiln.service")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	breaking := []string{
		"PrivateUsers", "RestrictNamespaces", "ProtectControlGroups", "ProtectKernelTunables",
		"ProtectHostname", "PrivateDevices", "DevicePolicy", "DeviceAllow", "ProtectClock",
		"MemoryDenyWriteExecute", "SystemCallFilter", "CapabilityBoundingSet", "User", "DynamicUser",
	}
	keys := map[string]string{}
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if k, v, ok := strings.Cut(line, "="); ok && !strings.HasPrefix(line, "#") {
			keys[k] = v
		}
	}
	for _, k := range breaking {
		if v, ok := keys[k]; ok {
			t.Errorf("%s=%s would keep kiln from making boxes", k, v)
		}
	}
	if got := keys["ExecStart"]; got != "/usr/local/bin/kiln serve --config /etc/kiln/kiln.toml" {
		t.Errorf("ExecStart=%s", got)
	}
	for _, k := range []string{"ProtectSystem", "ProtectHome", "PrivateTmp", "NoNewPrivileges", "RestrictAddressFamilies"} {
		if _, ok := keys[k]; !ok {
			t.Errorf("%s is missing", k)
		}
	}
}
