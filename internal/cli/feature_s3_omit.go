//go:build !kiln_s3

package cli

import (
	"context"

	"kiln/internal/session"
)

// Without the tag kiln_s3, --saves-bucket says how to get a kiln that
// shares saves.

func openSharedSaves(context.Context, savesBucket) (session.SharedSaves, error) {
	return nil, featureS3.missing()
}

const hasS3 = false
