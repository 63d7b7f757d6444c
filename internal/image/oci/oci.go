// Package oci packs kiln's box image, the root filesystem of the microVM
// image with the agent as its entrypoint, as an OCI image and pushes it to
// a registry, for the Kubernetes backend. It is the only user of
// go-containerregistry, and only a kiln built with the tag kiln_oci
// imports it (see internal/cli/image_oci.go).
package oci

import (
	"archive/tar"
	"compress/gzip"
	"context"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"maps"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/google/go-containerregistry/pkg/authn"
	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/tarball"

	"kiln/internal/boxpolicy"
	"kiln/internal/guestinit"
	"kiln/internal/image"
)

// Options say where Build pushes.
type Options struct {
	// Ref is the image reference to push to ("registry:5000/kiln/box:v1").
	Ref string
	// Insecure allows a registry over plain HTTP (loopback registries are
	// reached over HTTP anyway).
	Insecure bool
	// Node, when set, is the path of a kiln binary: the image is then a
	// kiln node's (contrib/kubernetes/node.yaml), the same root with that
	// kiln at NodePath beside the agent, started as root as `kiln node`.
	// The node's jail binds the image's /usr into its boxes as a host's.
	Node string
}

// NodePath is where a node image holds kiln, beside guestinit.AgentPath,
// where the jail looks for its agent.
const NodePath = "/sbin/kiln"

// Build builds the box image of the Kubernetes backend from the same
// Debian root filesystem and agent as the microVM image (the cached base
// of opts, built first if need be) and pushes it to o.Ref. It returns the
// pushed reference by digest.
func Build(ctx context.Context, opts image.Options, o Options) (string, error) {
	var nopts []name.Option
	if o.Insecure {
		nopts = append(nopts, name.Insecure)
	}
	ref, err := name.ParseReference(o.Ref, nopts...)
	if err != nil {
		return "", fmt.Errorf("parsing image reference %q: %w", o.Ref, err)
	}
	root, agent, err := image.BuildRoot(ctx, opts)
	if err != nil {
		return "", err
	}
	img, err := ociImage(root, agent, o.Node)
	if err != nil {
		return "", err
	}
	log := opts.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	var digest v1.Hash
	err = image.Step(ctx, log, "push "+ref.String(), func(ctx context.Context) error {
		if err := remote.Write(ref, img, remote.WithContext(ctx), remote.WithAuthFromKeychain(authn.DefaultKeychain)); err != nil {
			return err
		}
		digest, err = img.Digest()
		return err
	})
	if err != nil {
		return "", fmt.Errorf("pushing the image: %w", err)
	}
	return ref.Context().Digest(digest.String()).String(), nil
}

// ociImage is one layer, the root filesystem with the agent at
// guestinit.AgentPath, and a config that starts the agent as the box's
// non-root user in the workspace. With node, the path of a kiln, the
// layer also holds it at NodePath and the config starts it as root as
// `kiln node`.
func ociImage(root, agent, node string) (v1.Image, error) {
	extra := map[string]string{strings.TrimPrefix(guestinit.AgentPath, "/"): agent}
	if node != "" {
		extra[strings.TrimPrefix(NodePath, "/")] = node
	}
	layer, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) {
		pr, pw := io.Pipe()
		go func() { pw.CloseWithError(writeRootTar(pw, root, extra)) }()
		return pr, nil
	}, tarball.WithCompressionLevel(gzip.BestSpeed))
	if err != nil {
		return nil, fmt.Errorf("packing the image layer: %w", err)
	}
	img, err := mutate.AppendLayers(empty.Image, layer)
	if err != nil {
		return nil, fmt.Errorf("packing the image: %w", err)
	}
	cf, err := img.ConfigFile()
	if err != nil {
		return nil, err
	}
	cf = cf.DeepCopy()
	cf.Architecture, cf.OS = runtime.GOARCH, "linux"
	cf.Created = v1.Time{Time: time.Unix(0, 0).UTC()}
	cf.Config.Entrypoint = []string{guestinit.AgentPath}
	cf.Config.Env = boxpolicy.Env
	cf.Config.User = fmt.Sprintf("%d:%d", boxpolicy.UID, boxpolicy.GID)
	cf.Config.WorkingDir = boxpolicy.Workspace
	cf.Config.Labels = map[string]string{"org.opencontainers.image.title": "kiln box"}
	if node != "" {
		cf.Config.Entrypoint = []string{NodePath, "node"}
		cf.Config.User = "0:0"
		cf.Config.WorkingDir = "/"
		cf.Config.Labels["org.opencontainers.image.title"] = "kiln node"
	}
	return mutate.ConfigFile(img, cf)
}

// writeRootTar writes root as a tar stream, with each file of extra (by
// its path in the image, without the leading slash) from the host path
// it names, replacing whatever is there, and the mount points
// of a box's volumes. Devices, sockets and fifos are left out (the
// runtime makes /dev); hard links are written as copies. Times are zero,
// so two builds of the same inputs give the same layer.
func writeRootTar(w io.Writer, root string, extra map[string]string) error {
	tw := tar.NewWriter(w)
	epoch := time.Unix(0, 0)
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(root, p)
		if _, replaced := extra[rel]; err != nil || rel == "." || replaced {
			return err
		}
		fi, err := d.Info()
		if err != nil {
			return err
		}
		link := ""
		switch {
		case fi.Mode()&fs.ModeSymlink != 0:
			if link, err = os.Readlink(p); err != nil {
				return err
			}
		case fi.IsDir(), fi.Mode().IsRegular():
		default:
			return nil
		}
		h, err := tar.FileInfoHeader(fi, link)
		if err != nil {
			return err
		}
		h.Name = rel
		if fi.IsDir() {
			h.Name += "/"
		}
		if st, ok := fi.Sys().(*syscall.Stat_t); ok {
			h.Uid, h.Gid = int(st.Uid), int(st.Gid)
		}
		h.Uname, h.Gname = "", ""
		h.ModTime, h.AccessTime, h.ChangeTime = epoch, time.Time{}, time.Time{}
		h.Format = tar.FormatPAX
		if err := tw.WriteHeader(h); err != nil {
			return err
		}
		if fi.Mode().IsRegular() {
			f, err := os.Open(p)
			if err != nil {
				return err
			}
			_, err = io.CopyN(tw, f, h.Size)
			f.Close()
			if err != nil {
				return fmt.Errorf("packing %s: %w", rel, err)
			}
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("packing the root filesystem: %w", err)
	}
	for _, rel := range slices.Sorted(maps.Keys(extra)) {
		data, err := os.ReadFile(extra[rel])
		if err != nil {
			return fmt.Errorf("reading %s for /%s: %w", extra[rel], rel, err)
		}
		h := &tar.Header{Name: rel, Mode: 0o755, Size: int64(len(data)), ModTime: epoch, Typeflag: tar.TypeReg, Format: tar.FormatPAX}
		if err := tw.WriteHeader(h); err != nil {
			return err
		}
		if _, err := tw.Write(data); err != nil {
			return err
		}
	}
	return tw.Close()
}
