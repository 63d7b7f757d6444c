package image

import (
	"bytes"
	"debug/elf"
	"fmt"
	"io/fs"
	"path/filepath"
	"strings"
)

// modName normalizes a module name: the kernel treats "-" and "_" alike.
func modName(s string) string {
	return strings.ReplaceAll(strings.TrimSuffix(filepath.Base(s), ".ko"), "-", "_")
}

// indexModules maps module names to their .ko files under dir.
func indexModules(dir string) (map[string]string, error) {
	idx := map[string]string{}
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if !d.IsDir() && strings.HasSuffix(p, ".ko") {
			idx[modName(p)] = p
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("indexing modules: %w", err)
	}
	return idx, nil
}

// moduleDepends reads the "depends=" entry of a module's .modinfo section.
func moduleDepends(path string) ([]string, error) {
	f, err := elf.Open(path)
	if err != nil {
		return nil, fmt.Errorf("reading module %s: %w", filepath.Base(path), err)
	}
	defer f.Close()
	sec := f.Section(".modinfo")
	if sec == nil {
		return nil, nil
	}
	b, err := sec.Data()
	if err != nil {
		return nil, fmt.Errorf("reading module %s: %w", filepath.Base(path), err)
	}
	for _, kv := range bytes.Split(b, []byte{0}) {
		if v, ok := bytes.CutPrefix(kv, []byte("depends=")); ok {
			var out []string
			for _, d := range strings.Split(string(v), ",") {
				if d != "" {
					out = append(out, modName(d))
				}
			}
			return out, nil
		}
	}
	return nil, nil
}

// orderModules returns want and everything it depends on, each after its
// dependencies. builtin names are skipped (they need no loading).
func orderModules(want []string, builtin map[string]bool, deps func(name string) ([]string, error)) ([]string, error) {
	var order []string
	state := map[string]int{} // 1 visiting, 2 done
	var visit func(n string, path []string) error
	visit = func(n string, path []string) error {
		n = modName(n)
		if builtin[n] || state[n] == 2 {
			return nil
		}
		if state[n] == 1 {
			return fmt.Errorf("ordering modules: dependency cycle %s", strings.Join(append(path, n), " → "))
		}
		state[n] = 1
		ds, err := deps(n)
		if err != nil {
			return err
		}
		for _, d := range ds {
			if err := visit(d, append(path, n)); err != nil {
				return err
			}
		}
		state[n] = 2
		order = append(order, n)
		return nil
	}
	for _, w := range want {
		if err := visit(w, nil); err != nil {
			return nil, err
		}
	}
	return order, nil
}
