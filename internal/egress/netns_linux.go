//go:build linux

package egress

import (
	"fmt"
	"os"
)

// writeSysctl sets a /proc/sys value in the calling thread's namespaces;
// call it inside netnsrun.In.
func writeSysctl(path, value string) error {
	if err := os.WriteFile("/proc/sys/"+path, []byte(value), 0); err != nil {
		return fmt.Errorf("setting %s: %w", path, err)
	}
	return nil
}
