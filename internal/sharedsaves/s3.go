// Package sharedsaves keeps sessions' saves in an S3-compatible bucket
// that many kiln servers share (session.SharedSaves): a session resumes
// on whichever server its client reaches next, from the newest save any
// of them made.
//
// Each session's save is one object, <prefix><key>, replaced by every
// save; the time it was taken rides in its metadata (x-amz-meta-kiln-saved,
// Unix nanoseconds). The client is minio-go, which speaks to any
// S3-compatible server (AWS S3, Ceph RGW, SeaweedFS, versitygw, MinIO, R2,
// GCS in its S3 mode).
package sharedsaves

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"net/http"
	"net/url"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/minio/minio-go/v7"
	"github.com/minio/minio-go/v7/pkg/credentials"

	"kiln/internal/session"
)

// Options say which bucket, and how to reach it.
type Options struct {
	// Bucket is s3://BUCKET or s3://BUCKET/PREFIX.
	Bucket string
	// Endpoint is the server's URL, https://host[:port] (http:// only
	// where nothing but the server can see the traffic); "" is AWS S3.
	Endpoint string
	// Region is the bucket's region; "" asks the server (or AWS_REGION).
	Region string
	// Credentials: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and
	// AWS_SESSION_TOKEN), else the file AWS_SHARED_CREDENTIALS_FILE or
	// ~/.aws/credentials (profile AWS_PROFILE), else the platform's
	// identity (a Kubernetes service account's web identity token, ECS,
	// EC2's instance role). Never a flag: flags show in ps.
}

// metaSaved is the metadata key for when a save was taken (minio-go
// sends it as x-amz-meta-kiln-saved).
const metaSaved = "Kiln-Saved"

// Bucket is the shared saves in one bucket, under one prefix.
type Bucket struct {
	c      *minio.Client
	bucket string
	prefix string
	name   string // s3://bucket/prefix at endpoint, for logs
}

var _ session.SharedSaves = (*Bucket)(nil)

// Open connects to the bucket and checks that it is there and that kiln
// may read it.
func Open(ctx context.Context, o Options) (*Bucket, error) {
	bucket, prefix, err := parseBucket(o.Bucket)
	if err != nil {
		return nil, err
	}
	host, secure := "s3.amazonaws.com", true
	if o.Endpoint != "" {
		u, err := url.Parse(o.Endpoint)
		if err != nil || u.Host == "" || (u.Scheme != "https" && u.Scheme != "http") || (u.Path != "" && u.Path != "/") || u.RawQuery != "" || u.User != nil {
			return nil, fmt.Errorf("--saves-endpoint %q: want https://host[:port] (or http:// for a server only this host can reach)", o.Endpoint)
		}
		host, secure = u.Host, u.Scheme == "https"
	}
	region := o.Region
	if region == "" {
		region = os.Getenv("AWS_REGION")
	}
	c, err := minio.New(host, &minio.Options{
		Creds:  credentials.NewChainCredentials(providers()),
		Secure: secure,
		Region: region,
		// Path-style for any endpoint but AWS's own: most S3-compatible
		// servers take no bucket in the host name.
		BucketLookup: lookup(o.Endpoint),
		Transport:    transport(),
		MaxRetries:   3,
	})
	if err != nil {
		return nil, fmt.Errorf("--saves-bucket: %w", err)
	}
	b := &Bucket{c: c, bucket: bucket, prefix: prefix, name: fmt.Sprintf("s3://%s/%s at %s", bucket, prefix, host)}
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	ok, err := c.BucketExists(ctx, bucket)
	switch {
	case err != nil:
		return nil, fmt.Errorf("shared saves: cannot use %s: %w (kiln's credentials come from AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, else ~/.aws/credentials, else the platform's identity)", b.name, err)
	case !ok:
		return nil, fmt.Errorf("shared saves: there is no bucket %q at %s (kiln does not make one: make it, private, with a lifecycle rule if you want one)", bucket, host)
	}
	return b, nil
}

// parseBucket splits s3://bucket/prefix; the prefix ends in "/" unless
// it is empty.
func parseBucket(s string) (bucket, prefix string, err error) {
	rest, ok := strings.CutPrefix(s, "s3://")
	if !ok {
		return "", "", fmt.Errorf("--saves-bucket %q: want s3://BUCKET[/PREFIX]", s)
	}
	bucket, prefix, _ = strings.Cut(rest, "/")
	if bucket == "" || strings.ContainsAny(bucket, " ?#\\") {
		return "", "", fmt.Errorf("--saves-bucket %q: want s3://BUCKET[/PREFIX]", s)
	}
	prefix = strings.Trim(prefix, "/")
	if strings.Contains(prefix, "//") || strings.ContainsAny(prefix, "?#\\") {
		return "", "", fmt.Errorf("--saves-bucket %q: the prefix must be a plain path", s)
	}
	if prefix != "" {
		prefix += "/"
	}
	return bucket, prefix, nil
}

func providers() []credentials.Provider {
	return []credentials.Provider{
		&credentials.EnvAWS{},
		&credentials.FileAWSCredentials{},
		&credentials.IAM{Client: &http.Client{Transport: transport(), Timeout: 10 * time.Second}},
	}
}

func lookup(endpoint string) minio.BucketLookupType {
	if endpoint == "" {
		return minio.BucketLookupAuto
	}
	return minio.BucketLookupPath
}

// transport is the default one with bounded dials: a bucket that does not
// answer must not hold a call for minutes.
func transport() http.RoundTripper {
	t := http.DefaultTransport.(*http.Transport).Clone()
	t.DialContext = (&net.Dialer{Timeout: 10 * time.Second, KeepAlive: 30 * time.Second}).DialContext
	t.ResponseHeaderTimeout = 30 * time.Second
	return t
}

func (b *Bucket) String() string { return b.name }

// Put implements session.SharedSaves.
func (b *Bucket) Put(ctx context.Context, key string, saved time.Time, size int64, body io.Reader) error {
	opts := minio.PutObjectOptions{
		ContentType:  "application/x-tar",
		UserMetadata: map[string]string{metaSaved: strconv.FormatInt(saved.UnixNano(), 10)},
		PartSize:     16 << 20,
	}
	_, err := b.c.PutObject(ctx, b.bucket, b.prefix+key, body, size, opts)
	return err
}

// Stat implements session.SharedSaves.
func (b *Bucket) Stat(ctx context.Context, key string) (session.SharedSave, error) {
	info, err := b.c.StatObject(ctx, b.bucket, b.prefix+key, minio.StatObjectOptions{})
	if err != nil {
		return session.SharedSave{}, notExist(err)
	}
	return saveOf(info)
}

// Get implements session.SharedSaves.
func (b *Bucket) Get(ctx context.Context, key string) (io.ReadCloser, session.SharedSave, error) {
	obj, err := b.c.GetObject(ctx, b.bucket, b.prefix+key, minio.GetObjectOptions{})
	if err != nil {
		return nil, session.SharedSave{}, notExist(err)
	}
	info, err := obj.Stat() // the first request: what was read is this object
	if err != nil {
		obj.Close()
		return nil, session.SharedSave{}, notExist(err)
	}
	s, err := saveOf(info)
	if err != nil {
		obj.Close()
		return nil, s, err
	}
	return obj, s, nil
}

// Delete implements session.SharedSaves.
func (b *Bucket) Delete(ctx context.Context, key string) error {
	err := b.c.RemoveObject(ctx, b.bucket, b.prefix+key, minio.RemoveObjectOptions{})
	if errors.Is(notExist(err), fs.ErrNotExist) {
		return nil
	}
	return err
}

// Expire implements session.SharedSaves. A listing gives no metadata, so
// an object's age is its upload's, which follows its save at once.
func (b *Bucket) Expire(ctx context.Context, cutoff time.Time, keep func(string) bool) (int, error) {
	n := 0
	for obj := range b.c.ListObjects(ctx, b.bucket, minio.ListObjectsOptions{Prefix: b.prefix}) {
		if obj.Err != nil {
			return n, obj.Err
		}
		key := strings.TrimPrefix(obj.Key, b.prefix)
		if strings.Contains(key, "/") || !obj.LastModified.Before(cutoff) || keep(key) {
			continue
		}
		if err := b.c.RemoveObject(ctx, b.bucket, obj.Key, minio.RemoveObjectOptions{}); err != nil {
			return n, err
		}
		n++
	}
	return n, nil
}

// saveOf reads what kiln wrote beside an object.
func saveOf(info minio.ObjectInfo) (session.SharedSave, error) {
	for k, v := range info.UserMetadata {
		if !strings.EqualFold(k, metaSaved) && !strings.EqualFold(k, "X-Amz-Meta-"+metaSaved) {
			continue
		}
		ns, err := strconv.ParseInt(v, 10, 64)
		if err != nil || ns <= 0 {
			break
		}
		return session.SharedSave{Saved: time.Unix(0, ns), Size: info.Size}, nil
	}
	return session.SharedSave{}, fmt.Errorf("the object %s has no %s metadata: not a save kiln made", info.Key, metaSaved)
}

// notExist maps S3's "no such key" to fs.ErrNotExist.
func notExist(err error) error {
	if err == nil {
		return nil
	}
	if r := minio.ToErrorResponse(err); r.Code == minio.NoSuchKey || r.StatusCode == http.StatusNotFound {
		return fmt.Errorf("%w: %v", fs.ErrNotExist, err)
	}
	return err
}
