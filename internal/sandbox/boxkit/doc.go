// Package boxkit is the host-side toolkit every sandbox backend builds on,
// so that lifecycle machinery is written once: a cleanup stack, the
// mountinfo parser, the owner stamp and orphan sweeper, cgroups,
// template caches, and the syscall policy as a seccomp program and as OCI
// seccomp.
package boxkit
