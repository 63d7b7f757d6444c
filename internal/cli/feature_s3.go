//go:build kiln_s3

package cli

import (
	"context"

	"kiln/internal/session"
	"kiln/internal/sharedsaves"
)

// Shared saves in an S3-compatible bucket, built in by the tag kiln_s3
// (see features.go): it links minio-go.

func openSharedSaves(ctx context.Context, o savesBucket) (session.SharedSaves, error) {
	return sharedsaves.Open(ctx, sharedsaves.Options{Bucket: o.bucket, Endpoint: o.endpoint, Region: o.region})
}

const hasS3 = true
