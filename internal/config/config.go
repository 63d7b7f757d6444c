// Package config reads kiln's configuration file and prints the effective
// configuration.
//
// The file is TOML whose keys are the names of the serving commands' flags,
// so a flag any package registers on the command's flag.FlagSet can be set
// from the file with no code of its own. Flags that belong to one part of
// kiln (a backend's own flags) sit in a table of that part
// ([backends.jail]) and only there, so one name always means one setting.
//
// Precedence, highest first: the command line, the environment variables
// bound to flags (Layout.Env), the file, the flag's default. Every key of
// the file is checked, also those a flag or the environment overrides, so
// a mistake in the file shows the first time kiln reads it. Unknown keys
// and values of the wrong type are errors that name the file, the line and
// the key.
package config

import (
	"errors"
	"flag"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/BurntSushi/toml"
)

// Source says where a flag's value came from.
type Source string

// The sources of a value, lowest precedence first.
const (
	Default Source = "default"
	File    Source = "file"
	Env     Source = "env"
	Flag    Source = "flag"
)

// Section is a table of the file that holds the flags of one part of kiln:
// [Group.Name], such as [backends.jail].
type Section struct {
	Group string
	Name  string
	Flags []string
	// Absent, if set, says that this part of kiln is not in this build
	// (and how to get it): a key in its table is refused with it.
	Absent error
}

// Layout says which keys a file may hold and where.
type Layout struct {
	// Known defines every flag the file may set: the configuration of
	// every serving command. A command that does not define one of them
	// accepts its key (after checking its value) and ignores it, so one
	// file serves kiln serve, kiln mcp and kiln run alike. Resolve sets
	// values on Known's flags to check them: give it a flag set of its
	// own.
	Known *flag.FlagSet
	// Sections place flags in tables; a flag listed in a section is not
	// valid at the top level.
	Sections []Section
	// Env binds environment variables to flags (flag name → variable).
	Env map[string]string
	// NotInFile are flags the file cannot set (the flag naming the file).
	NotInFile []string
}

// Values records where each flag of a resolved flag set got its value.
type Values struct {
	Path    string            // the file read; "" for none
	Sources map[string]Source // by flag name; a missing name is Default
	EnvVars map[string]string // by flag name: the variable that set it
}

// Source says where the named flag's value came from.
func (v *Values) Source(name string) Source {
	if s, ok := v.Sources[name]; ok {
		return s
	}
	return Default
}

// Resolve gives fs, whose command line is already parsed, the values of
// the environment (getenv) and of the file at path, whose content is data
// (nil: no file), where the command line did not set them.
func Resolve(fs *flag.FlagSet, path string, data []byte, l Layout, getenv func(string) (string, bool)) (*Values, error) {
	v := &Values{Path: path, Sources: map[string]Source{}, EnvVars: map[string]string{}}
	fs.Visit(func(f *flag.Flag) { v.Sources[f.Name] = Flag })
	names := make([]string, 0, len(l.Env))
	for name := range l.Env {
		names = append(names, name)
	}
	slices.Sort(names)
	for _, name := range names {
		env := l.Env[name]
		val, ok := getenv(env)
		if !ok || fs.Lookup(name) == nil || v.Sources[name] == Flag {
			continue
		}
		if err := fs.Set(name, val); err != nil {
			return nil, fmt.Errorf("%s: %w", env, err)
		}
		v.Sources[name] = Env
		v.EnvVars[name] = env
	}
	if data == nil {
		return v, nil
	}
	sets, err := parse(path, data, l)
	if err != nil {
		return nil, err
	}
	for _, s := range sets {
		if fs.Lookup(s.name) == nil || v.Sources[s.name] != "" {
			continue // another command's setting, or overridden
		}
		if err := fs.Set(s.name, s.value); err != nil {
			return nil, fmt.Errorf("%s:%d: %s: %w", path, s.line, s.name, err)
		}
		v.Sources[s.name] = File
	}
	return v, nil
}

// setting is one checked assignment of the file.
type setting struct {
	name, value string
	line        int
}

// parse checks every key of the file against the layout and returns its
// settings as flag values.
func parse(path string, data []byte, l Layout) ([]setting, error) {
	if l.Known == nil {
		return nil, errors.New("config: Layout.Known is nil")
	}
	var top map[string]toml.Primitive
	md, err := toml.Decode(string(data), &top)
	if err != nil {
		return nil, fileErr(path, err)
	}
	p := &parser{path: path, md: &md, l: l, owner: map[string]string{}}
	groups := map[string][]Section{}
	for _, s := range l.Sections {
		groups[s.Group] = append(groups[s.Group], s)
		for _, f := range s.Flags {
			p.owner[f] = "[" + s.Group + "." + s.Name + "]"
		}
	}
	var errs []error
	for _, key := range sortedKeys(top) {
		if secs, ok := groups[key]; ok {
			errs = append(errs, p.group(key, top[key], secs)...)
			continue
		}
		if owner, ok := p.owner[key]; ok {
			errs = append(errs, p.fail(top[key], fmt.Sprintf("%q is a setting of %s: put it in that table", key, owner)))
			continue
		}
		errs = append(errs, p.set(key, key, top[key]))
	}
	// In the file's order, not the keys'.
	slices.SortStableFunc(errs, func(a, b error) int { return lineOf(a) - lineOf(b) })
	return p.sets, errors.Join(errs...)
}

type parser struct {
	path  string
	md    *toml.MetaData
	l     Layout
	owner map[string]string // flag name → its table, for flags in sections
	sets  []setting
}

// group checks a table of sections, such as [backends].
func (p *parser) group(key string, prim toml.Primitive, secs []Section) []error {
	var names []string
	for _, s := range secs {
		names = append(names, s.Name)
	}
	var tables map[string]toml.Primitive
	if !p.table(prim, &tables) {
		return []error{p.fail(prim, fmt.Sprintf("%q must be a table of %s", key, strings.Join(names, ", ")))}
	}
	var errs []error
	for _, name := range sortedKeys(tables) {
		i := slices.IndexFunc(secs, func(s Section) bool { return s.Name == name })
		if i < 0 {
			errs = append(errs, p.fail(tables[name], fmt.Sprintf("unknown table [%s.%s] (known: %s)", key, name, strings.Join(names, ", "))))
			continue
		}
		var vals map[string]toml.Primitive
		if !p.table(tables[name], &vals) {
			errs = append(errs, p.fail(tables[name], fmt.Sprintf("%s.%s must be a table", key, name)))
			continue
		}
		for _, k := range sortedKeys(vals) {
			if secs[i].Absent != nil {
				errs = append(errs, p.fail(vals[k], secs[i].Absent.Error()))
				continue
			}
			if !slices.Contains(secs[i].Flags, k) {
				errs = append(errs, p.fail(vals[k], fmt.Sprintf("unknown key %q in [%s.%s] (known: %s)", k, key, name, strings.Join(secs[i].Flags, ", "))))
				continue
			}
			errs = append(errs, p.set(key+"."+name+"."+k, k, vals[k]))
		}
	}
	return errs
}

// table decodes prim into m if it is a table. (The TOML library decodes a
// value that is not a table into a map as an empty map, without an error.)
func (p *parser) table(prim toml.Primitive, m *map[string]toml.Primitive) bool {
	return p.md.PrimitiveDecode(prim, &tableCheck{}) == nil && p.md.PrimitiveDecode(prim, m) == nil
}

// tableCheck refuses any value but a table.
type tableCheck struct{}

func (tableCheck) UnmarshalTOML(data any) error {
	if _, ok := data.(map[string]any); !ok {
		return errors.New("not a table")
	}
	return nil
}

// set checks one value for the named flag and records it.
func (p *parser) set(key, name string, prim toml.Primitive) error {
	f := p.l.Known.Lookup(name)
	switch {
	case slices.Contains(p.l.NotInFile, name):
		return p.fail(prim, fmt.Sprintf("%q cannot be set in the file", key))
	case f == nil:
		return p.fail(prim, fmt.Sprintf("unknown key %q (no flag of kiln serve is named --%s)", key, name))
	}
	d := &decoder{f: f}
	if err := p.md.PrimitiveDecode(prim, d); err != nil {
		return p.at(prim, err)
	}
	p.sets = append(p.sets, setting{name: name, value: d.value, line: p.line(prim)})
	return nil
}

// fail returns msg as an error at the position of prim's key.
func (p *parser) fail(prim toml.Primitive, msg string) error {
	return p.at(prim, p.md.PrimitiveDecode(prim, &failer{msg: msg}))
}

// at names the file and line of a TOML error about prim.
func (p *parser) at(prim toml.Primitive, err error) error {
	err = fileErr(p.path, err)
	var le *lineError
	if errors.As(err, &le) && le.line == 0 {
		le.line = p.line(prim)
	}
	return err
}

// line is the line of prim's key: the TOML library only tells positions
// in errors, so it decodes prim into a value that refuses it. A table
// made implicitly by a dotted key (a.b = 1) has no line of its own; it
// gets its first key's.
func (p *parser) line(prim toml.Primitive) int {
	var pe toml.ParseError
	if errors.As(p.md.PrimitiveDecode(prim, &failer{msg: "position"}), &pe) && pe.Position.Line > 0 {
		return pe.Position.Line
	}
	var m map[string]toml.Primitive
	if !p.table(prim, &m) {
		return 0
	}
	first := 0
	for _, v := range m {
		if l := p.line(v); l > 0 && (first == 0 || l < first) {
			first = l
		}
	}
	return first
}

// failer refuses any value with its message.
type failer struct{ msg string }

func (f *failer) UnmarshalTOML(any) error { return errors.New(f.msg) }

// decoder turns a TOML value into the string form of a flag's value, by
// the flag's kind: booleans, integers, numbers, and strings for the rest
// (durations, paths, lists). The flag's own Set checks the string.
type decoder struct {
	f     *flag.Flag
	value string
}

func (d *decoder) UnmarshalTOML(data any) error {
	want, example := kind(d.f)
	ok := false
	switch v := data.(type) {
	case bool:
		d.value, ok = strconv.FormatBool(v), want == "a boolean"
	case int64:
		d.value, ok = strconv.FormatInt(v, 10), want == "an integer" || want == "a number"
	case float64:
		d.value, ok = strconv.FormatFloat(v, 'g', -1, 64), want == "a number"
	case string:
		d.value, ok = v, want == "a string"
	}
	if !ok {
		return fmt.Errorf("want %s (%s), not %s", want, example, tomlKind(data))
	}
	// The flag's own parser checks the value (a duration, a range) on a
	// copy that belongs to Layout.Known.
	if err := d.f.Value.Set(d.value); err != nil {
		return fmt.Errorf("invalid value %q: %v", d.value, err)
	}
	return nil
}

// kind is the TOML kind a flag takes, and an example of it.
func kind(f *flag.Flag) (want, example string) {
	if b, ok := f.Value.(interface{ IsBoolFlag() bool }); ok && b.IsBoolFlag() {
		return "a boolean", "true or false"
	}
	if g, ok := f.Value.(flag.Getter); ok {
		switch g.Get().(type) {
		case int, int64, uint, uint64:
			return "an integer", "such as " + f.DefValue
		case float64:
			return "a number", "such as " + f.DefValue
		case time.Duration:
			return "a string", `a duration such as "30s" or "5m"`
		}
	}
	return "a string", "in quotes"
}

func tomlKind(data any) string {
	switch data.(type) {
	case bool:
		return "a boolean"
	case int64:
		return "an integer"
	case float64:
		return "a float"
	case string:
		return "a string"
	case time.Time:
		return "a date-time"
	case []any, []map[string]any:
		return "an array"
	case map[string]any:
		return "a table"
	}
	return fmt.Sprintf("%T", data)
}

// lineError is a mistake at a line of the file.
type lineError struct {
	path string
	line int
	msg  string
}

func (e *lineError) Error() string { return fmt.Sprintf("%s:%d: %s", e.path, e.line, e.msg) }

func lineOf(err error) int {
	var le *lineError
	if errors.As(err, &le) {
		return le.line
	}
	return 0
}

// fileErr names the file and the line of a TOML error.
func fileErr(path string, err error) error {
	if err == nil {
		return nil
	}
	var pe toml.ParseError
	if errors.As(err, &pe) {
		msg := pe.Message
		if pe.LastKey != "" && !strings.Contains(pe.Message, strconv.Quote(pe.LastKey)) {
			msg = pe.LastKey + ": " + msg
		}
		return &lineError{path: path, line: pe.Position.Line, msg: msg}
	}
	return fmt.Errorf("%s: %w", path, err)
}

func sortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	return keys
}
