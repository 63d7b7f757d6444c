//go:build !kiln_benchknobs

package jail

// benchWeakening is always the zero value outside a bench-only build: no
// hardening measure can be turned off (weaken.go).
func benchWeakening() weakening { return weakening{} }
