package kernel

import _ "embed"

// Zygote is the fork server a jail zygote runs after the driver's
// prepare(), passed to the driver in KILN_ZYGOTE (see zygote.py).
//
//go:embed zygote.py
var Zygote string
