// Package ociimage builds and pushes a one-layer image of static files,
// for the test cluster's pause image and the smoke test's probe image.
package ociimage

import (
	"archive/tar"
	"bytes"
	"fmt"
	"io"
	"os"
	"runtime"
	"strings"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
)

// Push writes files (each "name=path", mode 0755, at the root) as one
// layer of a linux image for this machine's architecture with the given
// entrypoint and user, pushes it to ref over plain HTTP (the registry is
// on loopback) and returns its digest.
func Push(ref, entry, user string, files []string) (string, error) {
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, f := range files {
		nm, path, ok := strings.Cut(f, "=")
		if !ok || nm == "" || strings.Contains(nm, "..") {
			return "", fmt.Errorf("bad file %q (want name=path)", f)
		}
		data, err := os.ReadFile(path)
		if err != nil {
			return "", err
		}
		if err := tw.WriteHeader(&tar.Header{Name: nm, Mode: 0o755, Size: int64(len(data)), Typeflag: tar.TypeReg}); err != nil {
			return "", err
		}
		if _, err := tw.Write(data); err != nil {
			return "", err
		}
	}
	if err := tw.Close(); err != nil {
		return "", err
	}
	b := buf.Bytes()
	layer, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(b)), nil })
	if err != nil {
		return "", err
	}
	img, err := mutate.AppendLayers(empty.Image, layer)
	if err != nil {
		return "", err
	}
	cf, err := img.ConfigFile()
	if err != nil {
		return "", err
	}
	cf = cf.DeepCopy()
	cf.OS, cf.Architecture = "linux", runtime.GOARCH
	cf.Config = v1.Config{Entrypoint: []string{entry}, User: user, Env: []string{"PATH=/"}}
	img, err = mutate.ConfigFile(img, cf)
	if err != nil {
		return "", err
	}
	r, err := name.ParseReference(ref, name.Insecure)
	if err != nil {
		return "", err
	}
	if err := remote.Write(r, img); err != nil {
		return "", err
	}
	d, err := img.Digest()
	if err != nil {
		return "", err
	}
	return d.String(), nil
}
