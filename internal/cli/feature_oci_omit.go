//go:build !kiln_oci

package cli

import (
	"context"

	"kiln/internal/image"
)

// Without the tag kiln_oci, kiln image build --oci says how to get a kiln
// that pushes box images.

func buildOCI(ctx context.Context, opts image.Options, ref string, insecure bool, node string) (string, error) {
	return "", featureOCI.missing()
}

const hasOCI = false
