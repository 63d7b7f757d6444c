package cli

import (
	"fmt"
	"strings"
	"unicode/utf8"
)

// Box output is hostile input, and `kiln run` shows it to a person. A
// terminal obeys control characters: ESC starts sequences that clear the
// screen, retitle the window, set the clipboard (OSC 52), make links (OSC 8)
// or, on some terminals, answer back into the operator's shell; CR and
// backspaces overwrite what was shown; C1 characters (U+0080–U+009F) are
// sequence introducers of their own on terminals that honor them.
//
// visible renders every control character except newline and tab as a
// visible escape (ESC as \x1b, CR as \r, BEL as \a, U+009B as \u009b) and
// invalid UTF-8 as U+FFFD. `kiln run` applies it whether or not stdout is a
// terminal: its output is a rendering of a tool result for a person, and
// output captured to a file or a pipe is cat'ed or paged to a terminal
// later. Exact bytes are what the MCP tools and files are for.
func visible(s string) string {
	if !needsEscaping(s) {
		return s
	}
	var b strings.Builder
	b.Grow(len(s) + 16)
	for i := 0; i < len(s); {
		r, size := utf8.DecodeRuneInString(s[i:])
		switch {
		case r == utf8.RuneError && size == 1:
			b.WriteRune(utf8.RuneError)
		case r == '\n' || r == '\t':
			b.WriteRune(r)
		case r < 0x20 || r == 0x7f:
			if e, ok := shortEscapes[r]; ok {
				b.WriteString(e)
			} else {
				fmt.Fprintf(&b, `\x%02x`, r)
			}
		case r >= 0x80 && r <= 0x9f:
			fmt.Fprintf(&b, `\u%04x`, r)
		default:
			b.WriteString(s[i : i+size])
		}
		i += size
	}
	return b.String()
}

var shortEscapes = map[rune]string{'\a': `\a`, '\b': `\b`, '\f': `\f`, '\r': `\r`, '\v': `\v`}

func needsEscaping(s string) bool {
	for _, r := range s {
		if (r < 0x20 && r != '\n' && r != '\t') || (r >= 0x7f && r <= 0x9f) || r == utf8.RuneError {
			return true
		}
	}
	return false
}
