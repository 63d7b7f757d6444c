package session

import (
	"path/filepath"
	"strings"

	"kiln/internal/agentproto"
)

// HibernateNow hibernates the principal's session at once, as the reaper
// does once it is idle past --hibernate-after (benchmarks, tests).
func (m *Manager) HibernateNow(principal, name string) bool {
	m.mu.Lock()
	s, ok := m.sessions[key{principal, name}]
	m.mu.Unlock()
	if !ok || m.hib == nil {
		return false
	}
	m.hibernate(s)
	return s.wasHibernated()
}

// HeldJobBytes counts, apart from the manager's own accounting, the bytes
// of results the finished jobs of principal hold ("": every principal's).
func (m *Manager) HeldJobBytes(principal string) int64 {
	m.jobs.mu.Lock()
	defer m.jobs.mu.Unlock()
	var n int64
	for _, j := range m.jobs.byID {
		if principal != "" && j.principal != principal {
			continue
		}
		j.mu.Lock()
		if out := j.out; out != nil && out.ExecResult != nil {
			n += int64(len(out.Stdout.Text) + len(out.Stderr.Text))
			for _, b := range append([]agentproto.MimeBundle{out.Result}, out.Displays...) {
				for _, v := range b {
					n += int64(len(v))
				}
			}
		}
		for _, p := range j.produced {
			n += int64(len(p.Data))
		}
		j.mu.Unlock()
	}
	return n
}

// StoreBytes is the bytes the store's account holds, and those of the
// saves its tree holds on disk (every snap-* and n-* directory), counted
// apart from it.
func (m *Manager) StoreBytes() (tracked, onDisk int64) {
	st, err := m.store()
	if err != nil {
		return -1, -1
	}
	st.mu.Lock()
	tracked = st.total
	st.mu.Unlock()
	dirs, _ := filepath.Glob(filepath.Join(st.root, "p-*", "s-*", "*"))
	for _, d := range dirs {
		if name := filepath.Base(d); strings.HasPrefix(name, "snap-") || strings.HasPrefix(name, "n-") {
			onDisk += dirSize(d)
		}
	}
	return tracked, onDisk
}

// SharedKey names a session's save in shared storage.
var SharedKey = sharedKey

// Unpack is what a save from shared storage is unpacked by.
var Unpack = unpack

// Pack is what a save is put in shared storage as.
var Pack = pack

// PackedSize is the length of Pack's archive.
var PackedSize = packedSize

// WaitShared waits for the uploads to shared storage in flight.
func (m *Manager) WaitShared() {
	if m.hib != nil && m.hib.sh != nil {
		m.hib.sh.pushes.Wait()
	}
}
