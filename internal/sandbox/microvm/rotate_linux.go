package microvm

import "kiln/internal/sandbox/boxkit"

// Template rotation. Every clone of one template starts as a copy of its
// memory, so clones of one template share what was fixed when the
// template's guest booted and its python started: the guest kernel's
// KASLR offset and its memory layout, where libc, the heap and the stack
// of the agent and of python are mapped, python's string-hash seed, the
// addresses of its objects (id(object())), and glibc's stack canary and
// pointer guard. None of these can be changed in a running process, so
// what is shared is bounded instead: a template serves at most
// Options.TemplateMaxClones clones and is used for at most
// Options.TemplateMaxAge, then a fresh template replaces it. What can be
// reseeded is, at every restore: the guest kernel's RNG (guestinit, from
// host entropy) and python's random and numpy's global generator
// (sandbox.ReseedCell).
//
// Rotation is off the call path, as the jail's zygote does it
// (boxkit.TemplateCache): the replacement boots in the background when the
// current template has served three quarters of its clones or reached its
// age (checked when a clone is asked for: an idle server boots no VM), and
// takes over once the current one is exhausted. A saved template loaded
// at start counts its age from when it was saved. A replaced template
// serves no more clones and is closed when its last restore is done.

// Defaults of Options.TemplateMaxClones and TemplateMaxAge are in
// microvm.go.

// rotations reports the rotation counters.
func (b *Backend) rotations() boxkit.TemplateStats { return b.tpls.Stats() }
