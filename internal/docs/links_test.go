package docs

import (
	"bufio"
	"fmt"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"testing/fstest"
	"unicode"
)

// TestLinks checks the repository's own documents.
func TestLinks(t *testing.T) {
	root := repoRoot(t)
	files := []string{"README.md", "CONTRIBUTING.md"}
	err := fs.WalkDir(os.DirFS(root), "docs", func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if !d.IsDir() && strings.HasSuffix(p, ".md") {
			files = append(files, p)
		}
		return nil
	})
	if err != nil {
		t.Fatalf("walking docs: %v", err)
	}
	if len(files) < 3 {
		t.Fatalf("found only %v: the docs directory is missing", files)
	}
	problems, links, err := checkLinks(os.DirFS(root), files)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range problems {
		t.Error(p)
	}
	if links == 0 {
		t.Errorf("no relative link found in %v: the link parser is broken", files)
	}
	t.Logf("%d files, %d relative links", len(files), links)
}

// TestCheckLinks shows that the checker finds what it must.
func TestCheckLinks(t *testing.T) {
	files := map[string]string{
		"README.md": "# kiln\n\n## Quick start (Debian/Ubuntu, as root)\n\n" +
			"[a](docs/a.md) [b](docs/a.md#on-kubernetes---backend-kubernetes) [c](#quick-start-debianubuntu-as-root)\n" +
			"[web](https://example.org/x#y) [dir](docs/) [ref]\n\n[ref]: docs/a.md#two-1\n",
		"docs/a.md": "# A\n\n## On Kubernetes (`--backend kubernetes`)\n\n## Two\n\n## Two\n\n" +
			"### `KILN_*` knobs\n\n```\n[not a link](missing.md)\n```\n\n`[code](missing.md)`\n\n" +
			"[up](../README.md#kiln) [knobs](#kiln_-knobs) [self](a.md)\n",
		"bad.md": "# Bad\n\n[gone](docs/nothere.md) [anchor](docs/a.md#no-such) [local](#bad-1)\n" +
			"[dir anchor](docs/#x) [outside](../etc/passwd) [upper](#Bad)\n",
	}
	fsys := fstest.MapFS{}
	for name, text := range files {
		fsys[name] = &fstest.MapFile{Data: []byte(text)}
	}
	problems, links, err := checkLinks(fsys, []string{"README.md", "docs/a.md"})
	if err != nil {
		t.Fatal(err)
	}
	if len(problems) != 0 || links != 8 {
		t.Errorf("good files: %d links, problems %q; want 8 links, none", links, problems)
	}
	problems, _, err = checkLinks(fsys, []string{"bad.md"})
	if err != nil {
		t.Fatal(err)
	}
	want := []string{
		`bad.md:3: "docs/nothere.md": no such file`,
		`bad.md:3: "docs/a.md#no-such": no heading "no-such" in docs/a.md`,
		`bad.md:3: "#bad-1": no heading "bad-1" in bad.md`,
		`bad.md:4: "docs/#x": an anchor into docs/, which is not a Markdown file`,
		`bad.md:4: "../etc/passwd": outside the repository`,
		`bad.md:4: "#Bad": no heading "Bad" in bad.md`,
	}
	if !slices.Equal(problems, want) {
		t.Errorf("problems:\n%s\nwant:\n%s", strings.Join(problems, "\n"), strings.Join(want, "\n"))
	}
}

func TestSlug(t *testing.T) {
	for _, c := range []struct{ heading, want string }{
		{"Quick start (Debian/Ubuntu, as root)", "quick-start-debianubuntu-as-root"},
		{"On Kubernetes (`--backend kubernetes`)", "on-kubernetes---backend-kubernetes"},
		{"The field-host VM (`make fieldhost-test`)", "the-field-host-vm-make-fieldhost-test"},
		{"Boxes' HOME, and `kiln run`", "boxes-home-and-kiln-run"},
		{"What `kiln bench` counts, and the targets it checks", "what-kiln-bench-counts-and-the-targets-it-checks"},
		{"The `KILN_*` knobs", "the-kiln_-knobs"},
		{"**Bold** and [a link](x.md)", "bold-and-a-link"},
		{"Hibernation: sessions that outlive the server", "hibernation-sessions-that-outlive-the-server"},
		{"Ünïcode stays", "ünïcode-stays"},
	} {
		if got := slug(c.heading); got != c.want {
			t.Errorf("slug(%q) = %q, want %q", c.heading, got, c.want)
		}
	}
}

var (
	inlineLink = regexp.MustCompile(`!?\[((?:[^\[\]]|\[[^\]]*\])*)\]\(\s*<?([^)\s>]*)>?(?:\s+"[^"]*")?\s*\)`)
	refDef     = regexp.MustCompile(`^ {0,3}\[[^\]]+\]:\s+<?(\S+?)>?(?:\s+"[^"]*")?\s*$`)
	codeSpan   = regexp.MustCompile("`+[^`]*`+")
	scheme     = regexp.MustCompile(`^[a-zA-Z][a-zA-Z0-9+.-]*:`)
	heading    = regexp.MustCompile(`^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$`)
)

// checkLinks returns one line per link that does not resolve, and the
// number of relative links it checked.
func checkLinks(fsys fs.FS, files []string) (problems []string, links int, err error) {
	anchors := map[string]map[string]bool{}
	anchorsOf := func(name string) (map[string]bool, error) {
		if a, ok := anchors[name]; ok {
			return a, nil
		}
		b, err := fs.ReadFile(fsys, name)
		if err != nil {
			return nil, err
		}
		a := map[string]bool{}
		seen := map[string]int{}
		for _, h := range headings(string(b)) {
			s := slug(h)
			if n := seen[s]; n > 0 {
				a[fmt.Sprintf("%s-%d", s, n)] = true
			} else {
				a[s] = true
			}
			seen[s]++
		}
		anchors[name] = a
		return a, nil
	}
	for _, file := range files {
		b, err := fs.ReadFile(fsys, file)
		if err != nil {
			return nil, 0, fmt.Errorf("reading %s: %w", file, err)
		}
		for _, l := range linksIn(string(b)) {
			if scheme.MatchString(l.dest) {
				continue
			}
			links++
			bad := func(format string, args ...any) {
				problems = append(problems, fmt.Sprintf("%s:%d: %q: ", file, l.line, l.dest)+fmt.Sprintf(format, args...))
			}
			target, anchor, _ := strings.Cut(l.dest, "#")
			name := file
			if target != "" {
				if strings.HasPrefix(target, "/") {
					name = path.Clean(strings.TrimPrefix(target, "/"))
				} else {
					name = path.Join(path.Dir(file), target)
				}
				if name == ".." || strings.HasPrefix(name, "../") {
					bad("outside the repository")
					continue
				}
				if _, err := fs.Stat(fsys, name); err != nil {
					bad("no such file")
					continue
				}
			}
			if anchor == "" {
				continue
			}
			if !strings.HasSuffix(name, ".md") {
				bad("an anchor into %s, which is not a Markdown file", target)
				continue
			}
			a, err := anchorsOf(name)
			if err != nil {
				return nil, 0, fmt.Errorf("reading %s: %w", name, err)
			}
			if !a[anchor] {
				bad("no heading %q in %s", anchor, name)
			}
		}
	}
	return problems, links, nil
}

type link struct {
	line int
	dest string
}

// linksIn returns the destinations of inline links, images and reference
// definitions outside fenced code blocks and code spans.
func linksIn(md string) []link {
	var out []link
	eachLine(md, func(n int, l string) {
		if m := refDef.FindStringSubmatch(l); m != nil {
			out = append(out, link{n, m[1]})
			return
		}
		for _, m := range inlineLink.FindAllStringSubmatch(codeSpan.ReplaceAllString(l, ""), -1) {
			out = append(out, link{n, m[2]})
		}
	})
	return out
}

// headings returns the text of every ATX heading outside fenced code.
func headings(md string) []string {
	var out []string
	eachLine(md, func(_ int, l string) {
		if m := heading.FindStringSubmatch(l); m != nil {
			out = append(out, m[2])
		}
	})
	return out
}

// eachLine calls f with every line outside fenced code blocks.
func eachLine(md string, f func(n int, line string)) {
	fence := ""
	sc := bufio.NewScanner(strings.NewReader(md))
	sc.Buffer(nil, 1<<20)
	for n := 1; sc.Scan(); n++ {
		l := sc.Text()
		t := strings.TrimLeft(l, " ")
		if fence != "" {
			if strings.HasPrefix(t, fence) {
				fence = ""
			}
			continue
		}
		if strings.HasPrefix(t, "```") || strings.HasPrefix(t, "~~~") {
			fence = t[:3]
			continue
		}
		f(n, l)
	}
}

var (
	mdLink = regexp.MustCompile(`!?\[([^\]]*)\]\([^)]*\)`)
	mdTag  = regexp.MustCompile(`<[^>]+>`)
)

// slug is GitHub's anchor for a heading: the rendered text in lower case,
// with everything but letters, marks, digits, underscores, hyphens and
// spaces removed, and each space a hyphen. (Duplicates get -1, -2, … in
// checkLinks.)
func slug(h string) string {
	h = mdLink.ReplaceAllString(h, "$1")
	h = mdTag.ReplaceAllString(h, "")
	h = strings.NewReplacer("`", "", "*", "").Replace(h)
	var b strings.Builder
	for _, r := range strings.ToLower(h) {
		switch {
		case r == ' ':
			b.WriteRune('-')
		case r == '-' || r == '_' || unicode.IsLetter(r) || unicode.IsDigit(r) || unicode.Is(unicode.M, r):
			b.WriteRune(r)
		}
	}
	return b.String()
}

// repoRoot is the directory holding go.mod, above this package.
func repoRoot(t *testing.T) string {
	dir, err := filepath.Abs(".")
	if err != nil {
		t.Fatal(err)
	}
	for {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			return dir
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			t.Fatal("no go.mod above the test's directory")
		}
		dir = parent
	}
}
