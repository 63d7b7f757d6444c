package cli

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"time"

	"log/slog"
)

// readConfig reads the config at path, refusing anything but a regular
// file there: kiln does not write through a symbolic link it was not
// told about.
func readConfig(path string) (data []byte, exists bool, err error) {
	fi, err := os.Lstat(path)
	switch {
	case errors.Is(err, os.ErrNotExist):
		return nil, false, nil
	case err != nil:
		return nil, false, err
	case fi.Mode()&os.ModeSymlink != 0:
		target, _ := os.Readlink(path)
		return nil, false, fmt.Errorf("%s is a symbolic link (to %s); kiln does not write through it: merge the entry by hand, or replace the link with the file", path, target)
	case !fi.Mode().IsRegular():
		return nil, false, fmt.Errorf("%s is not a regular file (%v); merge the entry by hand", path, fi.Mode().Type())
	}
	data, err = os.ReadFile(path)
	return data, true, err
}

// member is one key of a JSON object with its value as written.
type member struct {
	key   string
	value json.RawMessage
}

// parseObject splits a JSON object into its members, in order, leaving
// each value as written. what names the value in errors ("" for the file).
func parseObject(data []byte, what string) ([]member, error) {
	dec := json.NewDecoder(bytes.NewReader(data))
	tok, err := dec.Token()
	if err != nil {
		return nil, fmt.Errorf("not valid JSON: %w", err)
	}
	if tok != json.Delim('{') {
		kind := jsonKind(tok)
		if what == "" {
			return nil, fmt.Errorf("the file holds %s, not a JSON object", kind)
		}
		return nil, fmt.Errorf("%s is %s, not an object", what, kind)
	}
	var ms []member
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			return nil, fmt.Errorf("not valid JSON: %w", err)
		}
		var m member
		m.key, _ = tok.(string)
		if err := dec.Decode(&m.value); err != nil {
			return nil, fmt.Errorf("not valid JSON: %w", err)
		}
		ms = append(ms, m)
	}
	if _, err := dec.Token(); err != nil {
		return nil, fmt.Errorf("not valid JSON: %w", err)
	}
	if _, err := dec.Token(); err != io.EOF {
		return nil, errors.New("not valid JSON: data after the object")
	}
	return ms, nil
}

// jsonKind names the JSON value that starts with tok.
func jsonKind(tok json.Token) string {
	switch tok.(type) {
	case nil:
		return "null"
	case json.Delim:
		return "an array"
	case string:
		return "a string"
	case bool:
		return "a boolean"
	}
	return "a number"
}

// setMember replaces every member named key with one holding value, at the
// first one's place, or appends it.
func setMember(ms []member, key string, value json.RawMessage) []member {
	out := ms[:0:0]
	done := false
	for _, m := range ms {
		if m.key != key {
			out = append(out, m)
		} else if !done {
			out = append(out, member{key, value})
			done = true
		}
	}
	if !done {
		out = append(out, member{key, value})
	}
	return out
}

func encodeObject(ms []member) json.RawMessage {
	var b bytes.Buffer
	b.WriteByte('{')
	for i, m := range ms {
		if i > 0 {
			b.WriteByte(',')
		}
		k, _ := json.Marshal(m.key)
		b.Write(k)
		b.WriteByte(':')
		b.Write(m.value)
	}
	b.WriteByte('}')
	return b.Bytes()
}

// writeAtomic replaces path with data, with mode perm: a temporary file in
// the same directory, synced, then renamed over path.
func writeAtomic(path string, data []byte, perm os.FileMode) (err error) {
	f, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".tmp-*")
	if err != nil {
		return err
	}
	defer func() {
		if err != nil {
			f.Close()
			os.Remove(f.Name())
		}
	}()
	if err := f.Chmod(perm); err != nil {
		return err
	}
	if _, err := f.Write(data); err != nil {
		return err
	}
	if err := f.Sync(); err != nil {
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	if err := os.Rename(f.Name(), path); err != nil {
		return fmt.Errorf("replacing %s: %w", path, err)
	}
	return nil
}

func runDoctor(args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("kiln doctor", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var c common
	c.register(fs)
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	ok := 0
	width := 8
	for _, e := range registry {
		width = max(width, len(e.name))
	}
	for _, e := range registry {
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
		err := c.backends.checkBackend(ctx, e.name, backendEnv{agent: c.agent, log: discard()}, func(note string) {
			fmt.Fprintf(stderr, "%-*s note: %s\n", width, e.name, note)
		})
		cancel()
		if err == nil {
			ok++
			fmt.Fprintf(stdout, "%-*s ok\n", width, e.name)
		} else {
			fmt.Fprintf(stdout, "%-*s not available: %v\n", width, e.name, err)
		}
	}
	if ok == 0 {
		return errors.New("no backend works on this host")
	}
	return nil
}

func discard() *slog.Logger { return slog.New(slog.DiscardHandler) }
