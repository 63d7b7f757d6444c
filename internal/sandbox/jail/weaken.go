package jail

// weakening is what a bench-only build of kiln may turn off in the boxes
// it forks, to measure what each hardening measure costs (kiln bench's
// hardening rows). Only a binary built with the build tag
// kiln_benchknobs reads it from the environment (benchknobs.go); in every
// other build benchWeakening is a constant zero value (benchknobs_off.go),
// so nothing a client, a flag, a config file or the environment can do
// turns a measure off.
type weakening struct {
	seccomp  bool // an allow-everything filter instead of the allowlist
	landlock bool // no Landlock domain
	cgroups  bool // no cgroup of the box's own: it stays in the template's
}
