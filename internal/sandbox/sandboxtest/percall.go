package sandboxtest

// Canary serves conformance cases that live above the sandbox layer
// (sessiontest.RunPerCall needs package session, which this package must
// not import): a string no box holds unless it was given it.
func Canary() string { return canary() }
