package session

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"kiln/internal/config"
	"kiln/internal/sandbox"
)

// The snapshot store: the one place on disk for everything kiln saves of
// a session, hibernation's saves and named snapshots alike, with one
// layout, one account of the bytes it holds and one save path.
//
//	<root>/p-<sha256("kiln-principal\x00" + principal)[:16] hex>/
//	    s-<session>/
//	        owner            {"principal": …, "session": …}, checked on restore
//	        snap-<unix ns>/  hibernation: the session's newest save
//	        n-<name>/        a named snapshot (snapshot_session)
//	        .tmp-<random>/   a save being written; never read
//	    .tmp-<random>/       a fork's temporary copy of a session
//	    .gone-<random>/      a directory being removed
//
// The root is <state dir>/snapshots with a state directory
// (SnapshotOptions.StateDir), else HibernateOptions.Dir while hibernation
// is on, else a private temporary directory removed at Close. Every
// directory is 0700 and every file 0600, owned by the user running kiln:
// model code never sees them, and the host never decodes a box's bytes
// (the snapshot format is sandbox's business). Principal and session
// names are never file names of their own: a digest names the
// principal, and the s-, n- prefixes keep ValidName's "." and ".." names.
//
// The directory tree is the record. The store reads it once when it opens
// (moving in what an older kiln kept elsewhere, legacy.go) and keeps the
// size of every save it holds from then on, so a quota is a sum in
// memory, never a walk of the disk. One kiln serves one state directory.
//
// Quotas: a principal's hibernated sessions within HibernateOptions.Quota
// (past it, that principal's oldest are expired); its named snapshots and
// fork copies within SnapshotOptions.Quota (past it, the save is refused);
// everything of every principal within Options.StateQuota (past it, the
// oldest hibernated sessions of any principal are expired, those only on
// disk first; snapshots, which a client asked for by name, never are, and
// a save that would not fit even with every hibernation gone is refused,
// expiring none). With OIDC every subject is a new principal, hence the
// cap on all. What a save will write is claimed before it is written (the
// size its box declares, sandbox.WithSnapshotBudget), so saves in flight
// count at their full size whatever they have written so far, and a box
// that lies about its size is stopped before the host pulls the bytes.

// DefaultStateQuota is the default of Options.StateQuota.
const DefaultStateQuota = 16 << 30

// Errors of the store.
var (
	// ErrStateQuota is a save refused because every principal's saved
	// state together is at Options.StateQuota.
	ErrStateQuota = errors.New("kiln's disk space for saved state is used up")
	// ErrHibernateQuota is a snapshot larger than the principal's quota.
	ErrHibernateQuota = errors.New("the snapshot is larger than the hibernation quota")
	// errNotOwner is a saved session whose owner file names another
	// principal or session than the one asking for it.
	errNotOwner = errors.New("the saved session belongs to someone else")
)

// PrepareStateDir creates dir (0700) if it is missing and checks that
// only the user running kiln can reach it: hibernated sessions hold
// whatever the boxes held.
func PrepareStateDir(dir string) error {
	if dir == "" {
		return errors.New("no state directory given")
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("creating state directory: %w", err)
	}
	fi, err := os.Lstat(dir)
	if err != nil {
		return fmt.Errorf("checking state directory: %w", err)
	}
	if !fi.IsDir() {
		return fmt.Errorf("state directory %s is not a directory", dir)
	}
	if err := config.CheckOwner("state directory", dir, fi); err != nil {
		return err
	}
	if fi.Mode().Perm()&0o077 != 0 {
		if err := os.Chmod(dir, 0o700); err != nil {
			return fmt.Errorf("making state directory %s private: %w", dir, err)
		}
	}
	return nil
}

// store keeps sessions' saves on disk (see the layout above).
type store struct {
	root    string
	private bool // a temporary directory, removed at close
	log     *slog.Logger
	backend string // named in manifests that name none, and in errors
	// snapLimit caps one save: the box's workspace and memory limits.
	snapLimit int64
	// hibQuota and snapQuota bound one principal's hibernated sessions and
	// its named snapshots; stateQuota bounds everything.
	hibQuota, snapQuota, stateQuota int64
	// live says whether a session is live in memory: its save is the last
	// to be expired.
	live func(principal, session string) bool

	// mu guards what follows. It is held for bookkeeping and renames,
	// never while a box writes or a tree is removed, so a box that stalls
	// its own save holds up no one. It may be taken with no lock of the
	// Manager or of a Session held (live takes those).
	mu     sync.Mutex
	kept   map[string]*keptSave  // a kept save's directory → what it holds
	claims map[string]*saveClaim // a save's temporary directory → its claim
	total  int64                 // bytes of every kept save
}

// keptSave is one save on disk.
type keptSave struct {
	pdir string // its principal directory's base name
	// principal and session are what its session directory's owner file
	// says ("": it has none, an older kiln's named snapshot); owned says
	// the owner file names the directory it is in.
	principal, session string
	owned              bool
	hib                bool      // hibernation's save (snap-<ns>), else a named snapshot
	saved              time.Time // hibernation's: when it was taken
	bytes              int64
}

// saveClaim is the bytes a save in flight holds against the quotas.
type saveClaim struct {
	pdir   string
	hib    bool
	saving key // the session whose save it is ({}: a named snapshot's)
	bytes  int64
}

// storeConfig is what openStore needs.
type storeConfig struct {
	root                            string // "": a private temporary directory
	legacy                          string // a directory an older kiln hibernated sessions in ("": none)
	log                             *slog.Logger
	backend                         string
	snapLimit                       int64
	hibQuota, snapQuota, stateQuota int64
	live                            func(principal, session string) bool
}

// storeConfig is the store of the manager's options: see the layout.
func (m *Manager) storeConfig() storeConfig {
	o := m.opts
	c := storeConfig{log: m.log, backend: m.backendName(), snapLimit: sandbox.SnapshotLimitFor(o.Limits),
		hibQuota: o.Hibernate.Quota, snapQuota: o.Snapshots.Quota, stateQuota: o.StateQuota, live: m.isLive}
	hib := o.Hibernate.Dir != "" && o.Mode == ModeSession
	switch {
	case o.Snapshots.StateDir != "":
		c.root = filepath.Join(o.Snapshots.StateDir, "snapshots")
	case hib:
		c.root = o.Hibernate.Dir
	}
	if hib {
		c.legacy = o.Hibernate.Dir
	}
	return c
}

// openStore makes the store's root private, moves in what an older kiln
// left in c.legacy, and reads the sizes of what the root holds.
func openStore(c storeConfig) (*store, error) {
	st := &store{log: c.log, backend: c.backend, snapLimit: c.snapLimit, hibQuota: c.hibQuota,
		snapQuota: c.snapQuota, stateQuota: c.stateQuota, live: c.live,
		kept: make(map[string]*keptSave), claims: make(map[string]*saveClaim)}
	if c.root == "" {
		dir, err := os.MkdirTemp("", "kiln-snapshots-")
		if err != nil {
			return nil, fmt.Errorf("making the snapshot directory: %w", err)
		}
		st.root, st.private = dir, true
		return st, nil
	}
	root, err := filepath.Abs(c.root)
	if err != nil {
		return nil, fmt.Errorf("making the snapshot directory: %w", err)
	}
	st.root = root
	if err := os.MkdirAll(root, 0o700); err != nil {
		return nil, fmt.Errorf("making the snapshot directory: %w", err)
	}
	if err := os.Chmod(root, 0o700); err != nil {
		return nil, fmt.Errorf("making the snapshot directory private: %w", err)
	}
	if c.legacy != "" {
		st.adoptLegacy(c.legacy)
	}
	st.index(time.Now())
	return st, nil
}

// close removes a private root.
func (st *store) close() {
	if st.private {
		os.RemoveAll(st.root)
	}
}

// principalDirName names a principal's directory by a digest: principals
// are names from tokens, and may hold anything.
func principalDirName(principal string) string {
	h := sha256.Sum256([]byte("kiln-principal\x00" + principal))
	return "p-" + hex.EncodeToString(h[:16])
}

func (st *store) principalDir(principal string) string {
	return filepath.Join(st.root, principalDirName(principal))
}

func (st *store) sessionDir(principal, session string) string {
	return filepath.Join(st.principalDir(principal), "s-"+session)
}

func (st *store) snapDir(principal, session, name string) string {
	return filepath.Join(st.sessionDir(principal, session), "n-"+name)
}

// index reads the sizes of the saves under the root, and removes what a
// crash left behind: removals cut short, and saves half-written an hour
// ago (younger ones may be another kiln's, still being written).
func (st *store) index(now time.Time) {
	pents, _ := os.ReadDir(st.root)
	for _, p := range pents {
		if !p.IsDir() || !strings.HasPrefix(p.Name(), "p-") {
			continue
		}
		pdir := filepath.Join(st.root, p.Name())
		sents, _ := os.ReadDir(pdir)
		for _, s := range sents {
			path := filepath.Join(pdir, s.Name())
			switch {
			case sweepable(s, now):
				os.RemoveAll(path)
			case s.IsDir() && strings.HasPrefix(s.Name(), "s-"):
				st.indexSession(p.Name(), path, now)
			}
		}
	}
}

func (st *store) indexSession(pdir, sdir string, now time.Time) {
	o, err := readOwner(sdir)
	owned := err == nil && sdir == st.sessionDir(o.Principal, o.Session)
	ents, _ := os.ReadDir(sdir)
	for _, e := range ents {
		path := filepath.Join(sdir, e.Name())
		if sweepable(e, now) {
			os.RemoveAll(path)
			continue
		}
		if !e.IsDir() {
			continue
		}
		k := &keptSave{pdir: pdir, principal: o.Principal, session: o.Session, owned: owned}
		if t, ok := snapTime(e.Name()); ok {
			k.hib, k.saved = true, t
		} else if name, ok := strings.CutPrefix(e.Name(), "n-"); !ok || !ValidName(name) {
			continue
		}
		k.bytes = dirSize(path)
		st.kept[path] = k
		st.total += k.bytes
	}
}

// sweepable reports whether e is what a crash left: a removal cut short,
// or a save half-written for an hour (an older kiln's were snap-<ns>.tmp).
func sweepable(e fs.DirEntry, now time.Time) bool {
	name := e.Name()
	if strings.HasPrefix(name, gonePrefix) {
		return true
	}
	if !strings.HasPrefix(name, tmpPrefix) && !strings.HasSuffix(name, ".tmp") {
		return false
	}
	fi, err := e.Info()
	return err == nil && now.Sub(fi.ModTime()) > time.Hour
}

// snapTime is the time in a hibernation save's name, snap-<unix ns>.
func snapTime(name string) (time.Time, bool) {
	ns, ok := strings.CutPrefix(name, "snap-")
	if !ok {
		return time.Time{}, false
	}
	n, err := strconv.ParseInt(ns, 10, 64)
	if err != nil {
		return time.Time{}, false
	}
	return time.Unix(0, n), true
}

type ownerFile struct {
	Principal string `json:"principal"`
	Session   string `json:"session"`
}

const ownerName = "owner"

// writeOwner records who a session directory belongs to.
func writeOwner(dir, principal, name string) error {
	b, err := json.Marshal(ownerFile{Principal: principal, Session: name})
	if err != nil {
		return err
	}
	tmp := filepath.Join(dir, ownerName+".tmp")
	if err := os.WriteFile(tmp, b, 0o600); err != nil {
		return err
	}
	return os.Rename(tmp, filepath.Join(dir, ownerName))
}

// readOwner reads a session directory's owner file (bounded: it is ours,
// but a damaged disk is input too).
func readOwner(dir string) (ownerFile, error) {
	var o ownerFile
	f, err := os.Open(filepath.Join(dir, ownerName))
	if err != nil {
		return o, err
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, 64<<10))
	if err != nil {
		return o, err
	}
	if err := json.Unmarshal(b, &o); err != nil {
		return o, fmt.Errorf("reading owner file: %w", err)
	}
	return o, nil
}

// checkOwner refuses a session directory whose owner file names another
// principal or session. Without an owner file: err, or nil if missingOK
// (an older kiln wrote none for named snapshots).
func checkOwner(dir, principal, session string, missingOK bool) error {
	o, err := readOwner(dir)
	switch {
	case errors.Is(err, fs.ErrNotExist) && missingOK:
		return nil
	case errors.Is(err, fs.ErrNotExist):
		return fmt.Errorf("%w: it has no owner file", errNotOwner)
	case err != nil:
		return err
	case o.Principal != principal || o.Session != session:
		return errNotOwner
	}
	return nil
}

// own makes the session's directory, owned by principal.
func (st *store) own(principal, session string) error {
	dir := st.sessionDir(principal, session)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("creating session directory: %w", err)
	}
	o, err := readOwner(dir)
	if err == nil && o.Principal == principal && o.Session == session {
		return nil
	}
	// What the directory holds is not provably the principal's: with no
	// owner file only its named snapshots (an older kiln wrote none for
	// them), with another's owner file nothing. The rest goes before the
	// directory becomes theirs.
	foreign := !errors.Is(err, fs.ErrNotExist)
	var gone []string
	st.mu.Lock()
	ents, _ := os.ReadDir(dir)
	for _, e := range ents {
		_, hib := snapTime(e.Name())
		if hib || (foreign && strings.HasPrefix(e.Name(), "n-")) {
			gone = append(gone, st.removeLocked(filepath.Join(dir, e.Name())))
		}
	}
	for path, k := range st.kept {
		if filepath.Dir(path) == dir {
			k.principal, k.session, k.owned = principal, session, true
		}
	}
	st.mu.Unlock()
	removeAll(gone)
	if err := writeOwner(dir, principal, session); err != nil {
		return fmt.Errorf("writing owner file: %w", err)
	}
	return nil
}

// savedSnap is a hibernation save on disk.
type savedSnap struct {
	dir   string
	saved time.Time
}

// snapDirs lists the hibernation saves in a session directory, newest
// first.
func snapDirs(dir string) ([]savedSnap, error) {
	ents, err := os.ReadDir(dir)
	if err != nil {
		return nil, err
	}
	var out []savedSnap
	for _, e := range ents {
		if t, ok := snapTime(e.Name()); ok && e.IsDir() {
			out = append(out, savedSnap{dir: filepath.Join(dir, e.Name()), saved: t})
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].saved.After(out[j].saved) })
	return out, nil
}

// latest returns the newest hibernation save of the principal's session,
// after checking that the session directory is theirs. fs.ErrNotExist:
// none.
func (st *store) latest(principal, session string) (savedSnap, error) {
	dir := st.sessionDir(principal, session)
	snaps, err := snapDirs(dir)
	if err != nil {
		return savedSnap{}, err
	}
	if len(snaps) == 0 {
		return savedSnap{}, fs.ErrNotExist
	}
	if err := checkOwner(dir, principal, session, false); err != nil {
		return savedSnap{}, err
	}
	return snaps[0], nil
}

// saveReq says what a save is for: hibernation's save of the session
// (replacing its last), a named snapshot of it, or a fork's copy.
type saveReq struct {
	principal, session string
	hib                bool
	name               string // a named snapshot's name
	fork               bool   // a copy kept until forget
	// live overrides the store's live for what the save expires (shutdown
	// saves every session, none of them in memory any more).
	live func(principal, session string) bool
}

func (r saveReq) what() string {
	if r.fork {
		return "the fork's temporary copy of the session"
	}
	return "this snapshot"
}

// save snapshots box as r says, within the quotas, and returns where it
// is kept. Call it on the session's turn. A fork's copy counts against
// the principal's quota until forget(dir).
func (st *store) save(ctx context.Context, box sandbox.Sandbox, r saveReq) (string, *sandbox.SnapshotInfo, error) {
	sn, ok := inner(box).(sandbox.Snapshotter)
	if !ok {
		return "", nil, fmt.Errorf("%w on the %s backend: its boxes cannot save their state", ErrNoSnapshotBoxes, st.backend)
	}
	parent := st.principalDir(r.principal)
	if r.fork {
		if err := os.MkdirAll(parent, 0o700); err != nil {
			return "", nil, fmt.Errorf("making the snapshot directory: %w", err)
		}
	} else {
		if err := st.own(r.principal, r.session); err != nil {
			return "", nil, err
		}
		parent = st.sessionDir(r.principal, r.session)
	}
	taken := time.Now()
	tmp := filepath.Join(parent, tempName())
	if err := os.Mkdir(tmp, 0o700); err != nil {
		return "", nil, fmt.Errorf("making the snapshot directory: %w", err)
	}
	fail := func(err error) (string, *sandbox.SnapshotInfo, error) {
		st.forget(tmp)
		return "", nil, err
	}
	claim := func(n int64) error { return st.claim(tmp, n, r) }
	info, err := sn.Snapshot(sandbox.WithSnapshotBudget(sandbox.WithSnapshotLimit(ctx, st.snapLimit), claim), tmp)
	if err != nil {
		return fail(err)
	}
	if info == nil {
		info = &sandbox.SnapshotInfo{}
	} else if info.Backend == "" {
		info.Backend = st.backend
		if err := sandbox.WriteManifest(tmp, info); err != nil {
			return fail(err)
		}
	}
	// The manifest, or a box without a budget, may take more than was
	// claimed: what is kept must fit too.
	info.Bytes = dirSize(tmp)
	if err := claim(info.Bytes); err != nil {
		return fail(err)
	}
	if r.fork {
		return tmp, info, nil
	}
	dir, err := st.commit(tmp, taken, r)
	if err != nil {
		return fail(err)
	}
	return dir, info, nil
}

// fetch keeps, as the session's newest hibernation save, what fill writes
// into a temporary directory (a save from shared storage), within the
// quotas and the cap on one save as for any save: fill claims what it
// will write before it writes, and returns when the save was taken. Call
// it on the session's turn.
func (st *store) fetch(ctx context.Context, principal, session string, fill func(tmp string, claim func(int64) error) (time.Time, error)) (string, error) {
	if err := st.own(principal, session); err != nil {
		return "", err
	}
	r := saveReq{principal: principal, session: session, hib: true}
	tmp := filepath.Join(st.sessionDir(principal, session), tempName())
	if err := os.Mkdir(tmp, 0o700); err != nil {
		return "", fmt.Errorf("making the snapshot directory: %w", err)
	}
	claim := func(n int64) error {
		// A tar's headers come on top of the files (sharedSlack).
		if st.snapLimit > 0 && n > st.snapLimit+sharedSlack {
			return fmt.Errorf("the save is %d bytes, more than a box's limits let one save be (%d)", n, st.snapLimit)
		}
		return st.claim(tmp, n, r)
	}
	saved, err := fill(tmp, claim)
	if err == nil {
		err = claim(dirSize(tmp))
	}
	if err == nil {
		var dir string
		if dir, err = st.commit(tmp, saved, r); err == nil {
			return dir, nil
		}
	}
	st.forget(tmp)
	return "", err
}

// claim claims n bytes for the save being written into tmp, replacing
// what it claimed before, if they fit in the quotas; it may expire
// hibernated sessions to make room under the cap on all.
func (st *store) claim(tmp string, n int64, r saveReq) error {
	st.mu.Lock()
	var gone []string
	defer func() {
		st.mu.Unlock()
		removeAll(gone)
	}()
	delete(st.claims, tmp)
	c := &saveClaim{pdir: principalDirName(r.principal), hib: r.hib, bytes: n}
	if r.hib {
		c.saving = key{r.principal, r.session}
		if n > st.hibQuota {
			return fmt.Errorf("%w: %d bytes, quota %d bytes per principal (--hibernate-quota)", ErrHibernateQuota, n, st.hibQuota)
		}
	} else if used := st.usedLocked(c.pdir, false); used+n > st.snapQuota {
		return fmt.Errorf("%w: %s (%d bytes) would take your snapshots to %d of %d bytes (--snapshot-quota); delete_snapshot one you no longer need", ErrSnapshotQuota, r.what(), n, used+n, st.snapQuota)
	}
	var err error
	if gone, err = st.capLocked(n, c.saving, r.live); err != nil {
		return err
	}
	st.claims[tmp] = c
	return nil
}

// usedLocked is the bytes of the principal's hibernated sessions (hib) or
// its named snapshots and fork copies, saves in flight at their claims.
// Call it with mu held.
func (st *store) usedLocked(pdir string, hib bool) int64 {
	var n int64
	for _, k := range st.kept {
		if k.pdir == pdir && k.hib == hib {
			n += k.bytes
		}
	}
	for _, c := range st.claims {
		if c.pdir == pdir && c.hib == hib {
			n += c.bytes
		}
	}
	return n
}

// capLocked makes room for n more bytes under the cap on all, expiring
// hibernated sessions other than saving's, and returns the directories
// to remove once mu is released. Call it with mu held.
func (st *store) capLocked(n int64, saving key, live func(string, string) bool) (gone []string, err error) {
	used := st.total
	busy := map[string]bool{} // session directories with a save in flight
	for dir, c := range st.claims {
		used += c.bytes
		busy[filepath.Dir(dir)] = true
	}
	if used+n <= st.stateQuota {
		return nil, nil
	}
	var cands []string
	var free int64
	for path, k := range st.kept {
		if k.hib && k.owned && (key{k.principal, k.session}) != saving && !busy[filepath.Dir(path)] {
			cands = append(cands, path)
			free += k.bytes
		}
	}
	if used-free+n > st.stateQuota {
		return nil, fmt.Errorf("%w: saving %d bytes would take the saved state of all of kiln's clients (snapshots and hibernated sessions) to %d of %d bytes (--state-quota); delete_snapshot one you no longer need, or retry later", ErrStateQuota, n, used+n, st.stateQuota)
	}
	st.expireOrder(cands, live)
	for _, path := range cands {
		if used+n <= st.stateQuota {
			break
		}
		k := st.kept[path]
		st.log.Warn("expired a hibernated session to stay within the state directory's cap", "principal", k.principal, "session", k.session, "bytes", k.bytes, "state_quota", st.stateQuota)
		used -= k.bytes
		gone = append(gone, st.removeLocked(path))
	}
	return gone, nil
}

// expireOrder sorts hibernation saves in the order they give way:
// sessions only on disk first, then the last saves of live ones, oldest
// first in each. Hibernation happens without anyone asking for it, so the
// session least likely to be wanted again goes first. Call it with mu
// held.
func (st *store) expireOrder(paths []string, live func(string, string) bool) {
	if live == nil {
		live = st.live
	}
	isLive := map[string]bool{}
	for _, p := range paths {
		k := st.kept[p]
		isLive[p] = live(k.principal, k.session)
	}
	sort.SliceStable(paths, func(i, j int) bool {
		if isLive[paths[i]] != isLive[paths[j]] {
			return !isLive[paths[i]]
		}
		return st.kept[paths[i]].saved.Before(st.kept[paths[j]].saved)
	})
}

// commit keeps the save written into tmp under its name: a named
// snapshot replaces one of that name; hibernation's save replaces the
// session's older ones, expiring the principal's oldest other hibernated
// sessions until it fits in their quota.
func (st *store) commit(tmp string, taken time.Time, r saveReq) (string, error) {
	st.mu.Lock()
	var gone []string
	defer func() {
		st.mu.Unlock()
		removeAll(gone)
	}()
	sdir := filepath.Dir(tmp)
	c := st.claims[tmp]
	k := &keptSave{pdir: c.pdir, principal: r.principal, session: r.session, owned: true, hib: r.hib, saved: taken, bytes: c.bytes}
	dst := filepath.Join(sdir, "n-"+r.name)
	if r.hib {
		dst = filepath.Join(sdir, fmt.Sprintf("snap-%d", taken.UnixNano()))
		gone = st.makeRoomLocked(r, c.bytes)
	} else if _, err := os.Lstat(dst); err == nil {
		gone = append(gone, st.removeLocked(dst))
	}
	if err := os.Rename(tmp, dst); err != nil {
		return "", fmt.Errorf("keeping the snapshot: %w", err)
	}
	delete(st.claims, tmp)
	st.kept[dst] = k
	st.total += k.bytes
	if r.hib {
		snaps, _ := snapDirs(sdir)
		for _, old := range snaps {
			if old.dir != dst {
				gone = append(gone, st.removeLocked(old.dir))
			}
		}
	}
	return dst, nil
}

// makeRoomLocked expires the principal's oldest hibernated sessions,
// other than r's, until size more bytes fit in its quota, and returns
// the directories to remove. Call it with mu held.
func (st *store) makeRoomLocked(r saveReq, size int64) (gone []string) {
	pdir := principalDirName(r.principal)
	var total int64
	var others []string
	for path, k := range st.kept {
		if k.pdir != pdir || !k.hib {
			continue
		}
		if k.owned && k.principal == r.principal && k.session == r.session {
			continue
		}
		total += k.bytes
		if k.owned {
			others = append(others, path)
		}
	}
	st.expireOrder(others, r.live)
	for _, path := range others {
		if total+size <= st.hibQuota {
			break
		}
		k := st.kept[path]
		st.log.Warn("expired a hibernated session to stay within the principal's quota", "principal", k.principal, "session", k.session, "bytes", k.bytes, "quota", st.hibQuota)
		total -= k.bytes
		gone = append(gone, st.removeLocked(path))
	}
	return gone
}

// removeLocked forgets a kept save and moves it out of the way, so that
// no reader sees it half removed; the caller removes what it returns once
// mu is released. Call it with mu held.
func (st *store) removeLocked(dir string) string {
	if k, ok := st.kept[dir]; ok {
		st.total -= k.bytes
		delete(st.kept, dir)
	}
	gone := filepath.Join(filepath.Dir(dir), gonePrefix+newID())
	if os.Rename(dir, gone) == nil {
		return gone
	}
	return dir
}

// forget drops a save in flight or a fork's copy: its claim and its
// directory.
func (st *store) forget(tmp string) {
	st.mu.Lock()
	delete(st.claims, tmp)
	st.mu.Unlock()
	os.RemoveAll(tmp)
}

// remove deletes a kept save (delete_snapshot).
func (st *store) remove(dir string) error {
	st.mu.Lock()
	gone := st.removeLocked(dir)
	st.mu.Unlock()
	return os.RemoveAll(gone)
}

// removeHib forgets the session's hibernated state, leaving its named
// snapshots; true if there was some.
func (st *store) removeHib(principal, session string) bool {
	snaps, _ := snapDirs(st.sessionDir(principal, session))
	if len(snaps) == 0 {
		return false
	}
	var gone []string
	st.mu.Lock()
	for _, s := range snaps {
		gone = append(gone, st.removeLocked(s.dir))
	}
	st.mu.Unlock()
	removeAll(gone)
	return true
}

// listHib returns the principal's hibernated sessions, by name.
func (st *store) listHib(principal string) []SessionInfo {
	pdir := principalDirName(principal)
	st.mu.Lock()
	defer st.mu.Unlock()
	byName := map[string]SessionInfo{}
	for _, k := range st.kept {
		if k.pdir != pdir || !k.hib || !k.owned || k.principal != principal {
			continue
		}
		if si, ok := byName[k.session]; !ok || k.saved.After(si.Saved) {
			byName[k.session] = SessionInfo{Name: k.session, State: StateHibernated, Saved: k.saved, Bytes: k.bytes}
		}
	}
	out := make([]SessionInfo, 0, len(byName))
	for _, si := range byName {
		out = append(out, si)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out
}

// namedUsed is the bytes of the principal's named snapshots and fork
// copies, saves in flight at their claims.
func (st *store) namedUsed(principal string) int64 {
	st.mu.Lock()
	defer st.mu.Unlock()
	return st.usedLocked(principalDirName(principal), false)
}

// expire removes hibernation saves older than ttl of sessions that are
// not live.
func (st *store) expire(ttl time.Duration) {
	now := time.Now()
	var gone []string
	st.mu.Lock()
	for path, k := range st.kept {
		if !k.hib || now.Sub(k.saved) <= ttl || st.live(k.principal, k.session) {
			continue
		}
		st.log.Info("hibernated session expired", "principal", k.principal, "session", k.session, "saved", k.saved)
		gone = append(gone, st.removeLocked(path))
	}
	st.mu.Unlock()
	removeAll(gone)
}

const (
	gonePrefix = ".gone-"
	tmpPrefix  = ".tmp-"
)

func tempName() string {
	b := make([]byte, 8)
	rand.Read(b)
	return tmpPrefix + hex.EncodeToString(b)
}

func removeAll(dirs []string) {
	for _, d := range dirs {
		os.RemoveAll(d)
	}
}

// dirSize is the bytes of the regular files under dir.
func dirSize(dir string) int64 {
	var n int64
	filepath.WalkDir(dir, func(_ string, d fs.DirEntry, err error) error {
		if err == nil && d.Type().IsRegular() {
			if fi, err := d.Info(); err == nil {
				n += fi.Size()
			}
		}
		return nil
	})
	return n
}
