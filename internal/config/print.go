package config

import (
	"flag"
	"fmt"
	"io"
	"math"
	"slices"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"
)

// Print writes the configuration of fs as a TOML file that reproduces it:
// each flag's help as a comment, then its key. A value the command line,
// the environment or the file set is written as a setting with its source
// in a comment; a default is written commented out, so the output with
// nothing set is a sample file that sets nothing. head is written first,
// as comment lines.
func Print(w io.Writer, fs *flag.FlagSet, v *Values, l Layout, head string) error {
	var b strings.Builder
	for _, line := range strings.Split(strings.TrimRight(head, "\n"), "\n") {
		b.WriteString(strings.TrimRight("# "+line, " ") + "\n")
	}
	inSection := map[string]bool{}
	for _, s := range l.Sections {
		for _, f := range s.Flags {
			inSection[f] = true
		}
	}
	fs.VisitAll(func(f *flag.Flag) {
		if !inSection[f.Name] && !slices.Contains(l.NotInFile, f.Name) {
			b.WriteString("\n")
			writeFlag(&b, f, v)
		}
	})
	for _, s := range l.Sections {
		var fl []*flag.Flag
		for _, name := range s.Flags {
			if f := fs.Lookup(name); f != nil {
				fl = append(fl, f)
			}
		}
		if len(fl) == 0 {
			continue
		}
		fmt.Fprintf(&b, "\n[%s.%s]\n", s.Group, s.Name)
		slices.SortFunc(fl, func(a, b *flag.Flag) int { return strings.Compare(a.Name, b.Name) })
		for i, f := range fl {
			if i > 0 {
				b.WriteString("\n")
			}
			writeFlag(&b, f, v)
		}
	}
	_, err := io.WriteString(w, b.String())
	return err
}

func writeFlag(b *strings.Builder, f *flag.Flag, v *Values) {
	for _, line := range wrap(f.Usage, 76) {
		b.WriteString("# " + line + "\n")
	}
	src := v.Source(f.Name)
	val := tomlValue(f)
	if secret(f.Name) && src != Default {
		val = `"(set; not shown)"`
	}
	switch src {
	case Default:
		fmt.Fprintf(b, "# %s = %s\n", f.Name, val)
	case Env:
		fmt.Fprintf(b, "%s = %s # env %s\n", f.Name, val, v.EnvVars[f.Name])
	case Flag:
		fmt.Fprintf(b, "%s = %s # flag --%s\n", f.Name, val, f.Name)
	default:
		fmt.Fprintf(b, "%s = %s # %s\n", f.Name, val, src)
	}
}

// secret says whether a flag holds a secret whose value is never printed.
// Flags that name a file of secrets (token-file) hold only a path.
func secret(name string) bool {
	return strings.Contains(name, "secret") || strings.Contains(name, "password")
}

// tomlValue is the current value of f in TOML, by its kind.
func tomlValue(f *flag.Flag) string {
	s := f.Value.String()
	want, _ := kind(f)
	switch want {
	case "a boolean":
		if b, err := strconv.ParseBool(s); err == nil {
			return strconv.FormatBool(b)
		}
	case "an integer":
		if _, err := strconv.ParseInt(s, 10, 64); err == nil {
			return s
		}
		if _, err := strconv.ParseUint(s, 10, 64); err == nil {
			return s
		}
	case "a number":
		if g, ok := f.Value.(flag.Getter); ok {
			if x, ok := g.Get().(float64); ok {
				return tomlFloat(x)
			}
		}
	}
	if g, ok := f.Value.(flag.Getter); ok {
		if d, ok := g.Get().(time.Duration); ok {
			s = d.String()
		}
	}
	return tomlString(s)
}

func tomlFloat(x float64) string {
	switch {
	case math.IsNaN(x):
		return "nan"
	case math.IsInf(x, 1):
		return "inf"
	case math.IsInf(x, -1):
		return "-inf"
	}
	s := strconv.FormatFloat(x, 'g', -1, 64)
	if !strings.ContainsAny(s, ".e") {
		s += ".0"
	}
	return s
}

// tomlString quotes s as a TOML basic string.
func tomlString(s string) string {
	var b strings.Builder
	b.WriteByte('"')
	for _, r := range s {
		switch {
		case r == '"' || r == '\\':
			b.WriteByte('\\')
			b.WriteRune(r)
		case r == '\n':
			b.WriteString(`\n`)
		case r == '\t':
			b.WriteString(`\t`)
		case r == utf8.RuneError, r < 0x20, r == 0x7f, r >= 0x80 && r < 0xa0:
			fmt.Fprintf(&b, `\u%04X`, r)
		default:
			b.WriteRune(r)
		}
	}
	b.WriteByte('"')
	return b.String()
}

// wrap splits text into lines of at most width bytes, at spaces.
func wrap(text string, width int) []string {
	var lines []string
	line := ""
	for _, w := range strings.Fields(text) {
		if line != "" && len(line)+1+len(w) > width {
			lines = append(lines, line)
			line = ""
		}
		if line != "" {
			line += " "
		}
		line += w
	}
	if line != "" {
		lines = append(lines, line)
	}
	return lines
}
