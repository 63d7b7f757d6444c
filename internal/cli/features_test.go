package cli

import (
	"errors"
	"strings"
	"testing"

	"kiln/internal/image"
)

// skipLean skips a test that holds for the full build only (its premise
// is every optional feature, e.g. kiln.example.toml, which documents
// them all); make test runs this package's tests with and without them.
func skipLean(t *testing.T) {
	t.Helper()
	for _, f := range features {
		if !f.in {
			t.Skipf("kiln is built without %s here; run with -tags %s", f.what, fullTags)
		}
	}
}

// TestMissingFeatures: a kiln built without the kubernetes backend or OCI
// push answers everything that asks for them (the backend, its flags and
// its table in a file, kiln doctor, kiln k8s, kiln image build --oci)
// with an error naming the make target and the build tag that give a
// kiln with them; a full kiln has them all.
func TestMissingFeatures(t *testing.T) {
	cleanConfigEnv(t)
	k8s := kubernetesBackend.absent == nil
	oci := true
	if _, err := buildOCI(t.Context(), image.Options{}, "", false, ""); errors.As(err, new(*missingFeatureError)) {
		oci = false
	}
	if k8s != hasKubernetes || oci != hasOCI {
		t.Fatalf("kubernetes built in %v, OCI push %v; their registration files say %v, %v", k8s, oci, hasKubernetes, hasOCI)
	}
	if k8s != oci || oci != hasS3 {
		t.Fatalf("kubernetes built in %v, OCI push %v, shared saves %v: make build-full builds them all", k8s, oci, hasS3)
	}
	file := writeConfig(t, "[backends.kubernetes]\nk8s-namespace = \"boxes\"\n")
	for _, tc := range []struct {
		args []string
		tag  string
		in   bool // is it in this build
	}{
		{[]string{"run", "--backend", "kubernetes", "-c", "1"}, "kiln_kubernetes", k8s},
		{[]string{"run", "--k8s-namespace", "x", "-c", "1"}, "kiln_kubernetes", k8s},
		{[]string{"run", "--config", file, "-c", "1"}, "kiln_kubernetes", k8s},
		{[]string{"k8s", "seccomp-profile"}, "kiln_kubernetes", k8s},
		{[]string{"image", "build", "--oci", "localhost:5000/kiln/box:t"}, "kiln_oci", oci},
		{[]string{"run", "--state-dir", t.TempDir(), "--saves-bucket", "s3://kiln-saves", "-c", "1"}, "kiln_s3", hasS3},
	} {
		if tc.in {
			continue // it would build an image or reach a cluster
		}
		var stdout, stderr strings.Builder
		code := Main(tc.args, &stdout, &stderr)
		said := stderr.String()
		if code == 0 || !strings.Contains(said, "not in this build of kiln") || !strings.Contains(said, "make build-full") || !strings.Contains(said, tc.tag) {
			t.Errorf("kiln %s: exit %d, %q; want an error naming make build-full and the tag %s", strings.Join(tc.args, " "), code, said, tc.tag)
		}
	}
}
