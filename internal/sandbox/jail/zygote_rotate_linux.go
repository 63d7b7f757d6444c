package jail

import (
	"kiln/internal/sandbox/boxkit"
)

// Template rotation. Every box forked from one template starts as a copy
// of its memory, so boxes of one template share what was fixed when the
// template's python started: where libc, the heap and the stack are
// mapped, the stack canary and glibc's pointer guard (both from the
// template's AT_RANDOM), and Python's string-hash seed. None of these can
// be changed in a running process (live frames hold the canary, mangled
// pointers the guard, every dict the hash seed), so what is shared is
// bounded instead: a template serves at most Options.ZygoteMaxBoxes boxes
// and is used for at most Options.ZygoteMaxAge, then a fresh template
// replaces it. Generators that can be reseeded are, in each box (what
// sandbox.ReseedCode lists, which zygote.py runs from the plan; os.urandom
// reads the kernel and needs nothing).
//
// Rotation is off the call path (boxkit.TemplateCache): the replacement
// starts in the background when the current template has served three
// quarters of its boxes or reached its age, and takes over once the
// current one is exhausted. Templates are replaced at their age even when
// idle: a fresh one costs one python start.
//
// A template is the init of the pid namespace its boxes' namespaces are
// nested in, so its death would kill them: a replaced template is retired,
// makes no more boxes, and is stopped when the last box it made is gone.

// Defaults of Options.ZygoteMaxBoxes and Options.ZygoteMaxAge are in
// jail.go (DefaultZygoteMaxBoxes, DefaultZygoteMaxAge).

// zygoteRotation is the template cache's rotation for opts.
func zygoteRotation(opts Options) boxkit.Rotation {
	r := boxkit.Rotation{MaxUses: opts.ZygoteMaxBoxes, MaxAge: opts.ZygoteMaxAge, ReplaceIdle: true}
	if r.MaxUses == 0 {
		r.MaxUses = DefaultZygoteMaxBoxes
	}
	if r.MaxAge == 0 {
		r.MaxAge = DefaultZygoteMaxAge
	}
	return r
}
