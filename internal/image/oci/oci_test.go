package oci

import (
	"archive/tar"
	"errors"
	"io"
	"net/http/httptest"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"testing"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/registry"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/remote"

	"kiln/internal/boxpolicy"
	"kiln/internal/guestinit"
)

// TestOCIImageRoundTrip pushes the box image of a small root to a registry
// (go-containerregistry's, in memory) and pulls it back: the files, the
// agent replacing whatever was at its path, the links, and a config that
// starts the agent as the box's user. The node image holds kiln beside the
// agent and starts it as root as `kiln node`.
func TestOCIImageRoundTrip(t *testing.T) {
	t.Run("box", func(t *testing.T) { testRoundTrip(t, false) })
	t.Run("node", func(t *testing.T) { testRoundTrip(t, true) })
}

func testRoundTrip(t *testing.T, node bool) {
	root := t.TempDir()
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(os.MkdirAll(filepath.Join(root, "usr/bin"), 0o755))
	must(os.MkdirAll(filepath.Join(root, "sbin"), 0o755))
	must(os.MkdirAll(filepath.Join(root, "work"), 0o755))
	must(os.WriteFile(filepath.Join(root, "usr/bin/python3"), []byte("python"), 0o755))
	must(os.Symlink("usr/bin", filepath.Join(root, "bin")))
	must(os.WriteFile(filepath.Join(root, "sbin/kiln-agent"), []byte("stale agent"), 0o755))
	agent := filepath.Join(t.TempDir(), "kiln-agent")
	must(os.WriteFile(agent, []byte("new agent"), 0o755))

	kiln := ""
	if node {
		kiln = filepath.Join(t.TempDir(), "kiln")
		must(os.WriteFile(kiln, []byte("kiln itself"), 0o755))
	}
	img, err := ociImage(root, agent, kiln)
	must(err)
	srv := httptest.NewServer(registry.New())
	defer srv.Close()
	u, _ := url.Parse(srv.URL)
	ref, err := name.ParseReference(u.Host+"/kiln/box:t", name.Insecure)
	must(err)
	must(remote.Write(ref, img))
	got, err := remote.Image(ref)
	must(err)

	cf, err := got.ConfigFile()
	must(err)
	wantEntry, wantUser, wantDir := []string{guestinit.AgentPath}, "1000:1000", boxpolicy.Workspace
	if node {
		wantEntry, wantUser, wantDir = []string{NodePath, "node"}, "0:0", "/"
	}
	if !slices.Equal(cf.Config.Entrypoint, wantEntry) {
		t.Errorf("entrypoint %v, want %v", cf.Config.Entrypoint, wantEntry)
	}
	if cf.Config.User != wantUser || cf.Config.WorkingDir != wantDir || cf.OS != "linux" {
		t.Errorf("config user %q dir %q os %q, want user %q dir %q", cf.Config.User, cf.Config.WorkingDir, cf.OS, wantUser, wantDir)
	}
	files := map[string]string{}
	links := map[string]string{}
	tr := tar.NewReader(mutate.Extract(got))
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		must(err)
		switch h.Typeflag {
		case tar.TypeReg:
			b, _ := io.ReadAll(tr)
			if _, dup := files[h.Name]; dup {
				t.Errorf("%s twice in the layer", h.Name)
			}
			files[h.Name] = string(b)
		case tar.TypeSymlink:
			links[h.Name] = h.Linkname
		}
	}
	if files["sbin/kiln-agent"] != "new agent" {
		t.Errorf("agent in the image: %q", files["sbin/kiln-agent"])
	}
	if _, has := files["sbin/kiln"]; has != node || (node && files["sbin/kiln"] != "kiln itself") {
		t.Errorf("kiln in the image (node image %v): %q", node, files["sbin/kiln"])
	}
	if files["usr/bin/python3"] != "python" || links["bin"] != "usr/bin" {
		t.Errorf("root files %v links %v", files, links)
	}
}
