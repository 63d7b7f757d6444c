package image

import "runtime"

// OCIOptions say where BuildOCI pushes.
type OCIOptions struct {
	// Ref is the image reference to push to ("registry:5000/kiln/box:v1").
	Ref string
	// Insecure allows a registry over plain HTTP (loopback registries are
	// reached over HTTP anyway).
	Insecure bool
}

// goarch is the OCI architecture of images built here: the host's.
func goarch() string { return runtime.GOARCH }
