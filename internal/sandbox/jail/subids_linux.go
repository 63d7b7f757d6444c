package jail

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"os/user"
	"strconv"
	"strings"

	mobyuser "github.com/moby/sys/user"
	"golang.org/x/sys/unix"
)

// Rootless boxes with their own ids. A user who is not root can map only
// their own uid into a user namespace; the setuid helpers newuidmap and
// newgidmap (Debian's uidmap) map more, from the user's ranges in
// /etc/subuid and /etc/subgid. With them, a rootless box's root (its
// agent) is the user, as a rootless container's is, and its code runs as
// boxUID mapped to a subordinate uid of the box's own: not the user's, not
// another live box's (until the slots wrap). So code can signal, trace or
// read neither its agent nor the kiln server, which run as the user, the
// same way as under a root kiln.
//
// The maps must exist before the box's init runs anything as root of its
// namespace, and Go's exec can only write them itself. So the init starts
// in its new namespaces unmapped (awaitIDsArg), waits on its config pipe
// while the server runs the helpers, and executes itself again: an exec by
// uid 0 of the namespace gets every capability there, as a root one does.

// awaitIDsArg follows InitArg when the server maps the init's ids with
// newuidmap and newgidmap after it has started.
const awaitIDsArg = "await-ids"

// subIDs are the user's subordinate id ranges, the first of each file.
type subIDs struct {
	uid, gid             int64 // first subordinate uid, gid
	n                    int64 // ids in the smaller of the two ranges
	newuidmap, newgidmap string
}

// errNoSubIDs wraps every reason a rootless backend has no subordinate ids.
var errNoSubIDs = errors.New("no subordinate ids for rootless boxes")

// detectSubIDs finds the helpers and this user's ranges. Its error says
// exactly what is missing and how to get it (doctor prints it).
func detectSubIDs() (*subIDs, error) {
	var missing []string
	s := &subIDs{}
	var err error
	if s.newuidmap, err = lookHelper("newuidmap"); err != nil {
		missing = append(missing, "newuidmap is not installed (Debian, Ubuntu: sudo apt-get install uidmap)")
	}
	if s.newgidmap, err = lookHelper("newgidmap"); err != nil && s.newuidmap != "" {
		missing = append(missing, "newgidmap is not installed (Debian, Ubuntu: sudo apt-get install uidmap)")
	}
	name := strconv.Itoa(os.Getuid())
	if u, err := user.Current(); err == nil {
		name = u.Username
	}
	addIDs := fmt.Sprintf("sudo usermod --add-subuids 100000-165535 --add-subgids 100000-165535 %s", name)
	uids, uerr := mobyuser.CurrentUserSubUIDs()
	gids, gerr := mobyuser.CurrentUserSubGIDs()
	switch {
	case uerr != nil || len(uids) == 0:
		missing = append(missing, fmt.Sprintf("user %s has no range in /etc/subuid (%s, with a range no other user has)", name, addIDs))
	case gerr != nil || len(gids) == 0:
		missing = append(missing, fmt.Sprintf("user %s has no range in /etc/subgid (%s, with a range no other user has)", name, addIDs))
	default:
		s.uid, s.gid, s.n = uids[0].SubID, gids[0].SubID, min(uids[0].Count, gids[0].Count)
		if s.n < 1 {
			missing = append(missing, fmt.Sprintf("user %s's range in /etc/subuid or /etc/subgid is empty (%s)", name, addIDs))
		}
	}
	if len(missing) > 0 {
		return nil, fmt.Errorf("%w: %s", errNoSubIDs, strings.Join(missing, "; "))
	}
	return s, nil
}

// lookHelper finds a setuid helper in PATH, or in /usr/bin where uidmap
// puts it: an MCP client may start kiln with a PATH of its own.
func lookHelper(name string) (string, error) {
	p, err := exec.LookPath(name)
	if err == nil {
		return p, nil
	}
	if _, serr := os.Stat("/usr/bin/" + name); serr == nil {
		return "/usr/bin/" + name, nil
	}
	return "", err
}

// forSlot is the host uid and gid that boxUID and boxGID of the box in
// slot (nextSlot's, from 1) map to. Slots wrap around the range.
func (s *subIDs) forSlot(slot int) (uid, gid int64) {
	off := int64(slot-1) % s.n
	return s.uid + off, s.gid + off
}

// mapBox writes the id maps of the unmapped user namespace of process
// pid: the box's 0 is the user, boxUID and boxGID the slot's subordinate
// ids.
func (s *subIDs) mapBox(pid, slot int) error {
	uid, gid := s.forSlot(slot)
	p := strconv.Itoa(pid)
	runs := []struct {
		helper string
		args   []string
	}{
		{s.newuidmap, []string{p, "0", strconv.Itoa(os.Getuid()), "1", strconv.Itoa(boxUID), strconv.FormatInt(uid, 10), "1"}},
		{s.newgidmap, []string{p, "0", strconv.Itoa(os.Getgid()), "1", strconv.Itoa(boxGID), strconv.FormatInt(gid, 10), "1"}},
	}
	for _, r := range runs {
		cmd := exec.Command(r.helper, r.args...)
		var out bytes.Buffer
		cmd.Stdout, cmd.Stderr = &out, &out
		if err := cmd.Run(); err != nil {
			return fmt.Errorf("mapping box ids: %s %s: %w: %s", r.helper, strings.Join(r.args, " "), err, strings.TrimSpace(out.String()))
		}
	}
	return nil
}

// awaitIDs is the first life of an init started unmapped: it waits for
// the server's go-ahead on the config pipe (one newline, which the config's
// JSON decoder would skip anyway), checks that it is now uid 0 of its
// namespace, and executes itself again as the box's init.
func awaitIDs() error {
	var b [1]byte
	if n, err := unix.Read(3, b[:]); n != 1 || err != nil || b[0] != '\n' {
		return fmt.Errorf("waiting for the box's id maps: read %d bytes: %v", n, err)
	}
	if uid, gid := unix.Getuid(), unix.Getgid(); uid != 0 || gid != 0 {
		return fmt.Errorf("waiting for the box's id maps: still uid %d gid %d", uid, gid)
	}
	return fmt.Errorf("executing the mapped init: %w", unix.Exec("/proc/self/fd/4", []string{os.Args[0], InitArg}, []string{}))
}
