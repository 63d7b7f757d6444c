// Package boxtemplate keeps kiln's configured templates: the files an
// operator's setup code left in a box (kiln template create), kept in a
// root-only directory with a versioned manifest, and loaded by servers
// started with --template, whose every box sees them read-only.
//
// A template directory is
//
//	<dir>/<name>/manifest.json   the Manifest
//	<dir>/<name>/files/          bound at /template in every box
//
// The store only moves and checks files; building a template (running the
// setup in a box under the template's network policy) is the command
// line's business, and how a backend shows the files to its boxes is the
// backend's (jail.Options.Template).
package boxtemplate

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"syscall"
	"time"
)

// Format is the format of a template's manifest and files; a reader
// refuses any other, naming both.
const Format = "kiln-template/1"

// ManifestName is the manifest's file name in a template's directory.
const ManifestName = "manifest.json"

// FilesName is the directory, in a template's directory, that boxes see.
const FilesName = "files"

// Sentinel errors.
var (
	ErrNotFound = errors.New("no such template")
	ErrExists   = errors.New("a template of that name exists")
	ErrMismatch = errors.New("template made with another kiln or backend")
)

// Manifest describes a template: how it was made and with what.
type Manifest struct {
	Format      string    `json:"format"`
	Name        string    `json:"name"`
	KilnVersion string    `json:"kiln_version"`
	Backend     string    `json:"backend"`
	Created     time.Time `json:"created"`
	Setup       string    `json:"setup"`        // the setup file's base name
	SetupSHA256 string    `json:"setup_sha256"` // of its content
	AllowNet    string    `json:"allow_net,omitempty"`
	// Import lists the modules every box imports before it is handed out
	// (on the jail, the zygote imports them before it forks).
	Import []string      `json:"import,omitempty"`
	Bytes  int64         `json:"bytes"` // of the files
	Files  int           `json:"files"`
	Took   time.Duration `json:"took"` // how long the setup ran
}

// Template is a loaded template.
type Template struct {
	Manifest
	Dir string // the template's directory
}

// Files is the directory boxes see.
func (t *Template) FilesDir() string { return filepath.Join(t.Dir, FilesName) }

var nameRE = regexp.MustCompile(`^[a-z0-9][a-z0-9._-]{0,62}$`)

// ValidName checks a template's name: lower-case letters, digits, dots,
// dashes and underscores, starting with a letter or digit, at most 63.
func ValidName(name string) error {
	if !nameRE.MatchString(name) || strings.Contains(name, "..") {
		return fmt.Errorf("template name %q: use 1 to 63 of a-z, 0-9, '.', '-', '_', starting with a letter or digit", name)
	}
	return nil
}

// DefaultDir is where templates live unless told otherwise:
// /var/lib/kiln/templates for root (boxes' inits, unprivileged host uids,
// must be able to reach it; /root is closed to them), else kiln's
// directory in the user's cache.
func DefaultDir() (string, error) {
	if os.Geteuid() == 0 {
		return "/var/lib/kiln/templates", nil
	}
	d, err := os.UserCacheDir()
	if err != nil {
		return "", fmt.Errorf("finding a template directory (give --template-dir): %w", err)
	}
	return filepath.Join(d, "kiln", "templates"), nil
}

// Store is a directory of templates.
type Store struct {
	Dir string
}

// Open returns the store in dir ("": DefaultDir), creating it if it is
// missing: owned by whoever runs kiln, which only they can list or write;
// others (boxes' inits) can only pass through it to a template they name.
func Open(dir string) (*Store, error) {
	if dir == "" {
		d, err := DefaultDir()
		if err != nil {
			return nil, err
		}
		dir = d
	}
	dir, err := filepath.Abs(dir)
	if err != nil {
		return nil, err
	}
	if err := os.MkdirAll(dir, 0o711); err != nil {
		return nil, fmt.Errorf("creating template directory: %w", err)
	}
	st, err := os.Stat(dir)
	if err != nil {
		return nil, err
	}
	if err := checkOwner(dir, st); err != nil {
		return nil, err
	}
	if st.Mode().Perm()&0o022 != 0 {
		if err := os.Chmod(dir, 0o711); err != nil {
			return nil, err
		}
	}
	if err := checkReachable(dir); err != nil {
		return nil, err
	}
	s := &Store{Dir: dir}
	s.sweep(time.Now())
	return s, nil
}

// staleStage is how old a stage must be before Open takes it for the
// leftover of a kiln template create that was killed; a setup may run
// for its whole --timeout.
const staleStage = 48 * time.Hour

// sweep removes what killed commands left: removals under way (.rm-*)
// and stages older than staleStage (.new-*).
func (s *Store) sweep(now time.Time) {
	entries, _ := os.ReadDir(s.Dir)
	for _, e := range entries {
		name := e.Name()
		stale := strings.HasPrefix(name, ".rm-")
		if strings.HasPrefix(name, ".new-") {
			if info, err := e.Info(); err == nil && now.Sub(info.ModTime()) > staleStage {
				stale = true
			}
		}
		if stale {
			os.RemoveAll(filepath.Join(s.Dir, name))
		}
	}
}

// checkReachable makes sure that other users may pass through every
// directory above dir and dir itself: a box's init, an unprivileged host
// uid, binds a template's files by path.
func checkReachable(dir string) error {
	if os.Geteuid() != 0 {
		return nil // rootless boxes map to this user
	}
	for d := dir; ; d = filepath.Dir(d) {
		st, err := os.Stat(d)
		if err != nil {
			return err
		}
		if st.Mode().Perm()&0o001 == 0 {
			return fmt.Errorf("template directory %s: boxes cannot reach it, %s is closed to other users (mode %v; give --template-dir elsewhere or chmod o+x %s)", dir, d, st.Mode().Perm(), d)
		}
		if d == filepath.Dir(d) {
			return nil
		}
	}
}

// checkOwner refuses a directory someone else owns: whoever owns it could
// swap a template's files under a server.
func checkOwner(dir string, st fs.FileInfo) error {
	if s, ok := st.Sys().(*syscall.Stat_t); ok && int(s.Uid) != os.Geteuid() {
		return fmt.Errorf("template directory %s belongs to uid %d, not to this user (%d)", dir, s.Uid, os.Geteuid())
	}
	return nil
}

// Load reads template name and checks that kiln version and backend made
// it: a template from another kiln or backend is refused, with both named.
func (s *Store) Load(name, kilnVersion, backend string) (*Template, error) {
	t, err := s.read(name)
	if err != nil {
		return nil, err
	}
	if t.KilnVersion != kilnVersion {
		return nil, fmt.Errorf("template %q: %w: made with kiln %s, this is kiln %s (make it again: kiln template rm %s; kiln template create %s ...)", name, ErrMismatch, t.KilnVersion, kilnVersion, name, name)
	}
	if t.Backend != backend {
		return nil, fmt.Errorf("template %q: %w: made for the %s backend, this server uses %s", name, ErrMismatch, t.Backend, backend)
	}
	return t, nil
}

func (s *Store) read(name string) (*Template, error) {
	if err := ValidName(name); err != nil {
		return nil, err
	}
	dir := filepath.Join(s.Dir, name)
	raw, err := os.ReadFile(filepath.Join(dir, ManifestName))
	if errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("template %q: %w in %s (kiln template list shows them)", name, ErrNotFound, s.Dir)
	}
	if err != nil {
		return nil, fmt.Errorf("reading template %q: %w", name, err)
	}
	var m Manifest
	if err := json.Unmarshal(raw, &m); err != nil {
		return nil, fmt.Errorf("reading template %q: manifest: %w", name, err)
	}
	if m.Format != Format {
		return nil, fmt.Errorf("template %q: format %q, this kiln reads %q", name, m.Format, Format)
	}
	if m.Name != name {
		return nil, fmt.Errorf("template %q: its manifest names %q", name, m.Name)
	}
	st, err := os.Lstat(filepath.Join(dir, FilesName))
	if err != nil || !st.IsDir() {
		return nil, fmt.Errorf("template %q: no files directory", name)
	}
	return &Template{Manifest: m, Dir: dir}, nil
}

// Listed is one template in List: its manifest, or why it cannot be read.
type Listed struct {
	Name string
	*Template
	Err error
}

// List returns the store's templates by name.
func (s *Store) List() ([]Listed, error) {
	entries, err := os.ReadDir(s.Dir)
	if err != nil {
		return nil, err
	}
	var out []Listed
	for _, e := range entries {
		if !e.IsDir() || strings.HasPrefix(e.Name(), ".") {
			continue
		}
		t, err := s.read(e.Name())
		out = append(out, Listed{Name: e.Name(), Template: t, Err: err})
	}
	slices.SortFunc(out, func(a, b Listed) int { return strings.Compare(a.Name, b.Name) })
	return out, nil
}

// Remove deletes template name. Servers already started with it keep
// their binds of the files until they exit.
func (s *Store) Remove(name string) error {
	if err := ValidName(name); err != nil {
		return err
	}
	dir := filepath.Join(s.Dir, name)
	if _, err := os.Lstat(dir); err != nil {
		return fmt.Errorf("template %q: %w in %s", name, ErrNotFound, s.Dir)
	}
	// Rename first, so that no server loads a half-removed template.
	gone, err := os.MkdirTemp(s.Dir, ".rm-"+name+"-")
	if err != nil {
		return err
	}
	if err := os.Rename(dir, filepath.Join(gone, name)); err != nil {
		os.Remove(gone)
		return fmt.Errorf("removing template %q: %w", name, err)
	}
	return os.RemoveAll(gone)
}
