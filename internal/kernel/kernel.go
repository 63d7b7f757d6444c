// Package kernel holds kiln's Python kernel driver, a small program embedded
// in kiln-agent and run with the sandbox's python3. It implements IPython's
// last-expression display, the display protocol (_repr_png_, _repr_html_, …,
// display()), matplotlib capture on Agg and tracebacks that point at the
// cell's own lines, without Jupyter.
package kernel

import _ "embed"

// Driver is the driver's Python source.
//
//go:embed driver.py
var Driver string

// Bootstrap is the python3 -c argument that runs Driver, read from the
// KILN_DRIVER environment variable, in a namespace of its own so that the
// cells' __main__ stays clean.
const Bootstrap = `import os;exec(compile(os.environ.pop("KILN_DRIVER"),"<kiln-driver>","exec"),{"__name__":"kiln_driver"})`
