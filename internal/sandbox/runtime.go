package sandbox

import (
	"os/exec"
	"strings"
	"sync"
)

// notableLibraries are named in tool descriptions when importable.
var notableLibraries = []string{"numpy", "pandas", "matplotlib", "scipy", "sympy", "PIL", "sklearn", "requests", "bs4", "yaml"}

var (
	hostRuntimeMu sync.Mutex
	hostRuntimes  = map[string]Runtime{}
)

// HostRuntime asks a python on the host (the one a backend shows its boxes
// read-only) for its version and which notable libraries it has. It runs
// python once per path and process; a python that does not run gives the
// zero Runtime.
func HostRuntime(python string) Runtime {
	hostRuntimeMu.Lock()
	defer hostRuntimeMu.Unlock()
	if rt, ok := hostRuntimes[python]; ok {
		return rt
	}
	var rt Runtime
	script := `import importlib.util, sys
print(sys.version.split()[0])
for m in sys.argv[1:]:
    if importlib.util.find_spec(m): print(m)`
	out, err := exec.Command(python, append([]string{"-I", "-c", script}, notableLibraries...)...).Output()
	if lines := strings.Fields(string(out)); err == nil && len(lines) > 0 {
		rt = Runtime{Python: lines[0], Libraries: lines[1:]}
	}
	hostRuntimes[python] = rt
	return rt
}
