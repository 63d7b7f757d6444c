package session

import (
	"crypto/sha256"
	"encoding/hex"
	"os"
	"path/filepath"
	"strings"
)

// What older kilns left on disk, moved into the store when it opens so
// that an upgrade loses no one's hibernated session.
//
// Named snapshots were already where the store keeps them
// (<state dir>/snapshots/p-<digest>/s-<session>/n-<name>/), without an
// owner file: the store reads them as they are. Hibernated sessions were
// kept apart, in HibernateOptions.Dir (kiln used <state dir>/hibernated):
//
//	<Dir>/<sha256(principal)[:16] hex>/s-<session>/
//	    owner              {"principal": …, "session": …}
//	    snap-<unix ns>/    the newest complete snapshot
//	    snap-<unix ns>.tmp/  one being written
//
// A store that lived in HibernateOptions.Dir (hibernation without a state
// directory for snapshots) moves too when the store's root is elsewhere.

// legacyPrincipalDirName is an older kiln's name of a principal's
// hibernation directory.
func legacyPrincipalDirName(principal string) string {
	sum := sha256.Sum256([]byte(principal))
	return hex.EncodeToString(sum[:16])
}

// adoptLegacy moves the saved sessions found in dir into the store. Only
// a session directory whose owner file names the principal its
// directory's name was made from is moved, to that principal's place:
// what is not provably someone's stays where it is, unread.
func (st *store) adoptLegacy(dir string) {
	dir, err := filepath.Abs(dir)
	if err != nil {
		return
	}
	pents, _ := os.ReadDir(dir)
	for _, p := range pents {
		if !p.IsDir() {
			continue
		}
		pdir := filepath.Join(dir, p.Name())
		sents, _ := os.ReadDir(pdir)
		moved := false
		for _, s := range sents {
			src := filepath.Join(pdir, s.Name())
			if !s.IsDir() || !strings.HasPrefix(s.Name(), "s-") {
				continue
			}
			o, err := readOwner(src)
			if err != nil || !ValidName(o.Session) || s.Name() != "s-"+o.Session {
				continue
			}
			dst := st.sessionDir(o.Principal, o.Session)
			switch {
			case src == dst:
				continue
			case p.Name() == legacyPrincipalDirName(o.Principal):
			case p.Name() == principalDirName(o.Principal) && dir != st.root:
			default:
				continue
			}
			if st.adoptSession(src, dst, o) {
				moved = true
				st.log.Info("moved a saved session into the snapshot store", "principal", o.Principal, "session", o.Session, "from", src)
			}
		}
		if moved {
			os.Remove(pdir) // if it is empty now
		}
	}
}

// adoptSession moves the saves in session directory src to dst, keeping
// what dst already has of the same name, and removes src (with what a
// crash left half-written in it); true if it did.
func (st *store) adoptSession(src, dst string, o ownerFile) bool {
	if err := st.own(o.Principal, o.Session); err != nil {
		return false
	}
	ents, _ := os.ReadDir(src)
	for _, e := range ents {
		_, hib := snapTime(e.Name())
		if !e.IsDir() || !(hib || strings.HasPrefix(e.Name(), "n-")) {
			continue
		}
		to := filepath.Join(dst, e.Name())
		if _, err := os.Lstat(to); os.IsNotExist(err) {
			if os.Rename(filepath.Join(src, e.Name()), to) != nil {
				return false
			}
		}
	}
	discard(src)
	return true
}

// discard removes a directory so that no reader sees it half removed: it
// is renamed out of the way first, then removed.
func discard(dir string) {
	gone := filepath.Join(filepath.Dir(dir), gonePrefix+newID())
	if os.Rename(dir, gone) == nil {
		dir = gone
	}
	os.RemoveAll(dir)
}
