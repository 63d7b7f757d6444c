package jail

import (
	"os/exec"
	"strings"
	"sync"

	"kiln/internal/sandbox"
)

var (
	runtimeOnce sync.Once
	runtimeInfo sandbox.Runtime
)

// notableLibraries are named in tool descriptions when importable.
var notableLibraries = []string{"numpy", "pandas", "matplotlib", "scipy", "sympy", "PIL", "sklearn", "requests", "bs4", "yaml"}

// hostRuntime asks the host's python (the one bound into boxes) for its
// version and which notable libraries it has. It runs once per process.
func hostRuntime(python string) sandbox.Runtime {
	runtimeOnce.Do(func() {
		script := `import importlib.util, sys
print(sys.version.split()[0])
for m in sys.argv[1:]:
    if importlib.util.find_spec(m): print(m)`
		out, err := exec.Command(python, append([]string{"-I", "-c", script}, notableLibraries...)...).Output()
		if err != nil {
			return
		}
		lines := strings.Fields(string(out))
		if len(lines) > 0 {
			runtimeInfo.Python = lines[0]
			runtimeInfo.Libraries = lines[1:]
		}
	})
	return runtimeInfo
}
