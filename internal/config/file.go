package config

import (
	"fmt"
	"io"
	"os"
	"path/filepath"
)

// MaxFileSize bounds what ReadFile reads: a configuration is a few
// kilobytes, and a bound keeps a mistaken path (a log, a device) from
// filling memory.
const MaxFileSize = 1 << 20

// SystemPath is the configuration file of a system-wide kiln.
const SystemPath = "/etc/kiln/kiln.toml"

// UserPath is the configuration file of the user: kiln/kiln.toml under
// $XDG_CONFIG_HOME, or under ~/.config when that is unset. It is "" when
// neither gives an absolute directory.
func UserPath(getenv func(string) (string, bool)) string {
	if dir, _ := getenv("XDG_CONFIG_HOME"); filepath.IsAbs(dir) {
		return filepath.Join(dir, "kiln", "kiln.toml")
	}
	if home, _ := getenv("HOME"); filepath.IsAbs(home) {
		return filepath.Join(home, ".config", "kiln", "kiln.toml")
	}
	return ""
}

// Find returns the file to read when none was named: the user's file, else
// the system's, whichever exists first; "" when neither does.
func Find(getenv func(string) (string, bool)) string {
	for _, p := range []string{UserPath(getenv), SystemPath} {
		if p == "" {
			continue
		}
		if _, err := os.Lstat(p); err == nil {
			return p
		}
	}
	return ""
}

// ReadFile reads a configuration file after checking that no one but its
// owner, who must be root or the user running kiln, can change it: the file
// decides which binaries kiln runs (--agent, --runsc) and who may call it
// (--token-file), so a file others can write would hand them the server.
func ReadFile(path string) ([]byte, error) {
	f, err := OpenTrusted("configuration", path, false)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	data, err := io.ReadAll(io.LimitReader(f, MaxFileSize+1))
	if err != nil {
		return nil, fmt.Errorf("reading %s: %w", path, err)
	}
	if len(data) > MaxFileSize {
		return nil, fmt.Errorf("%s is larger than %d bytes; it is not a kiln configuration", path, MaxFileSize)
	}
	return data, nil
}
