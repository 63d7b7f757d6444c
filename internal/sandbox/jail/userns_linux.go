package jail

import (
	"fmt"
	"os"
	"os/exec"
	"strings"
	"syscall"
)

// userNamespaceControl starts /bin/true in a user namespace of its own,
// mapping only this user's uid, as any rootless box's init starts. Its
// error names the knob that refuses it (see UserNamespaceHints).
func userNamespaceControl() error {
	cmd := exec.Command("/bin/true")
	cmd.SysProcAttr = &syscall.SysProcAttr{
		Cloneflags:  syscall.CLONE_NEWUSER,
		UidMappings: []syscall.SysProcIDMap{{ContainerID: 0, HostID: os.Getuid(), Size: 1}},
		GidMappings: []syscall.SysProcIDMap{{ContainerID: 0, HostID: os.Getgid(), Size: 1}},
	}
	if err := cmd.Run(); err != nil {
		hints := UserNamespaceHints()
		if len(hints) == 0 {
			return fmt.Errorf("creating a user namespace as uid %d: %w", os.Getuid(), err)
		}
		return fmt.Errorf("creating a user namespace as uid %d: %w: %s", os.Getuid(), err, strings.Join(hints, "; "))
	}
	return nil
}

// userNamespaceKnobs are the sysctls that can keep an ordinary user from
// creating user namespaces, the value that refuses, and how to allow it.
var userNamespaceKnobs = []struct {
	file, refuses, hint string
}{
	{"/proc/sys/kernel/unprivileged_userns_clone", "0",
		"kernel.unprivileged_userns_clone is 0 (Debian's switch): sudo sysctl -w kernel.unprivileged_userns_clone=1, and put it in /etc/sysctl.d/ to keep it"},
	{"/proc/sys/user/max_user_namespaces", "0",
		"user.max_user_namespaces is 0: sudo sysctl -w user.max_user_namespaces=15000, and put it in /etc/sysctl.d/ to keep it"},
	{"/proc/sys/kernel/apparmor_restrict_unprivileged_userns", "1",
		"kernel.apparmor_restrict_unprivileged_userns is 1 (Ubuntu 23.10 and later): only programs with an AppArmor profile that allows userns may create one; install contrib/apparmor/kiln (sudo install -m 644 contrib/apparmor/kiln /etc/apparmor.d/kiln, with its path to the kiln binary edited, then sudo apparmor_parser -r /etc/apparmor.d/kiln)"},
}

// UserNamespaceHints names each sysctl on this host that refuses an
// ordinary user's user namespaces, with how to allow it.
func UserNamespaceHints() []string {
	var out []string
	for _, k := range userNamespaceKnobs {
		b, err := os.ReadFile(k.file)
		if err == nil && strings.TrimSpace(string(b)) == k.refuses {
			out = append(out, k.hint)
		}
	}
	return out
}
