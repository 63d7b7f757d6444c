package cli

import (
	"fmt"
	"strings"
)

// The parts of kiln that most hosts do not need and that would double its
// size and its build (the Kubernetes backend's client-go, OCI push's
// go-containerregistry, shared saves' minio-go) are left out of the default build the way
// tailscale leaves features out: each is a build tag and a small
// registration file, feature_<name>.go, built only with the tag, beside
// feature_<name>_omit.go, built without it, which puts in its place an
// answer that says how to get it. `make build-full` builds every one in;
// each binary's dependency list, with and without them, is checked in
// (cmd/*/depaware*.txt, make depaware).

// fullTags are the build tags of every optional feature.
const fullTags = "kiln_kubernetes,kiln_oci,kiln_s3"

// feature is one optional part of kiln.
type feature struct {
	tag  string // the build tag that builds it in
	what string // what it is, for people
	in   bool   // whether this kiln has it: set by its registration file
}

var (
	featureKubernetes = feature{tag: "kiln_kubernetes", what: "the kubernetes backend", in: hasKubernetes}
	featureOCI        = feature{tag: "kiln_oci", what: "OCI push (kiln image build --oci)", in: hasOCI}
	featureS3         = feature{tag: "kiln_s3", what: "shared saves in an S3-compatible bucket (--saves-bucket)", in: hasS3}
	features          = []feature{featureKubernetes, featureOCI, featureS3}
)

// featureLines say, for kiln version, which optional features this kiln
// has.
func featureLines() string {
	var b strings.Builder
	for _, f := range features {
		if f.in {
			fmt.Fprintf(&b, "  %s: built in (tag %s)\n", f.what, f.tag)
		} else {
			fmt.Fprintf(&b, "  %v\n", f.missing())
		}
	}
	return b.String()
}

// missing is the answer of a kiln built without f to whatever asks for it.
func (f feature) missing() error { return &missingFeatureError{f} }

// missingFeatureError says that a feature is not in this build, and how to
// get a kiln with it.
type missingFeatureError struct{ f feature }

func (e *missingFeatureError) Error() string {
	return fmt.Sprintf("%s is not in this build of kiln (the default build leaves it out, tag %s): build kiln with `make build-full` (go build -tags %s ./cmd/kiln)", e.f.what, e.f.tag, fullTags)
}

// hintMissingFlag adds to the error of a flag that is not defined the
// feature whose flags start the way it does, when that feature is not in
// this build.
func hintMissingFlag(err error) error {
	const undefined = "flag provided but not defined: -"
	msg := err.Error()
	name, ok := strings.CutPrefix(msg, undefined)
	if !ok {
		return err
	}
	for _, e := range registry {
		if e.absent != nil && e.flagPrefix != "" && strings.HasPrefix(strings.TrimLeft(name, "-"), e.flagPrefix) {
			return fmt.Errorf("%w: %w", err, e.absent)
		}
	}
	return err
}
