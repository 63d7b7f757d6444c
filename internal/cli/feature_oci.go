//go:build kiln_oci

package cli

import (
	"context"

	"kiln/internal/image"
	"kiln/internal/image/oci"
)

// OCI push, built in by the tag kiln_oci (see features.go): it links
// go-containerregistry.

func buildOCI(ctx context.Context, opts image.Options, ref string, insecure bool, node string) (string, error) {
	return oci.Build(ctx, opts, oci.Options{Ref: ref, Insecure: insecure, Node: node})
}

const hasOCI = true
