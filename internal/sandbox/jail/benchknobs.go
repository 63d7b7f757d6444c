//go:build kiln_benchknobs

package jail

import (
	"fmt"
	"log/slog"
	"os"
	"strings"
	"sync"
)

// WeakenEnv names the hardening measures a bench-only build turns off in
// every forked box, comma-separated: seccomp, landlock, cgroups. It is
// read only in binaries built with -tags kiln_benchknobs (make
// bench-kiln), for kiln bench's hardening rows; never ship one.
const WeakenEnv = "KILN_BENCH_WEAKEN"

var benchWeakening = sync.OnceValue(func() weakening {
	var w weakening
	v := os.Getenv(WeakenEnv)
	for _, f := range strings.Split(v, ",") {
		switch strings.TrimSpace(f) {
		case "":
		case "seccomp":
			w.seccomp = true
		case "landlock":
			w.landlock = true
		case "cgroups":
			w.cgroups = true
		default:
			panic(fmt.Sprintf("%s: unknown measure %q (seccomp, landlock, cgroups)", WeakenEnv, f))
		}
	}
	if w != (weakening{}) {
		slog.Warn("bench-only build: hardening measures turned off in every forked box", "measures", v)
	}
	return w
})
