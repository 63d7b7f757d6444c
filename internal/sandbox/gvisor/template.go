package gvisor

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"

	specs "github.com/opencontainers/runtime-spec/specs-go"

	"kiln/internal/boxpolicy"
)

// A configured template (Options.Template, kiln template) is a host
// directory of files an operator's setup made: modules installed with pip
// --target into its python directory, data files. Every box's OCI spec
// binds it read-only at boxpolicy.TemplateDir, nosuid and nodev, and puts
// its python directory on PYTHONPATH, as the jail does. The spec of the
// warm-start template box has the same bind (the mount is part of the
// template's key), so the box imports the template's modules (they are
// in its preloads) before its checkpoint, and runsc restore, which
// requires the restored spec's mounts to match the checkpointed one's,
// reopens the same directory through the gofer in every restored box.
// Writes are refused by the sentry (read-only mount) and, below it, by
// the host: the files belong to the host's root and the gofer opens the
// bind read-only.

// prepareTemplate checks Options.Template. A writable template (the
// setup) disables warm start: the setup's box must see what it writes,
// and no other box may share it.
func prepareTemplate(opts *Options) error {
	if opts.Template == "" {
		if opts.TemplateWritable {
			return errors.New("gvisor backend: TemplateWritable without a Template")
		}
		return nil
	}
	if !filepath.IsAbs(opts.Template) {
		return fmt.Errorf("gvisor backend: template directory %q is not an absolute path", opts.Template)
	}
	st, err := os.Stat(opts.Template)
	if err != nil {
		return fmt.Errorf("gvisor backend: template directory: %w", err)
	}
	if !st.IsDir() {
		return fmt.Errorf("gvisor backend: template directory %s is not a directory", opts.Template)
	}
	if opts.TemplateWritable {
		opts.Cold = true
	}
	return nil
}

// templateMounts is the template's bind in a box's spec, if it has one.
func templateMounts(c boxConfig) []specs.Mount {
	if c.Template == "" {
		return nil
	}
	mode := "ro"
	if c.TemplateRW {
		mode = "rw"
	}
	return []specs.Mount{{Destination: boxpolicy.TemplateDir, Type: "bind", Source: c.Template, Options: []string{"rbind", mode, "nosuid", "nodev"}}}
}

// templateEnv is what a box with a template finds in its environment, as
// on the jail.
func templateEnv(c boxConfig) []string {
	if c.Template == "" {
		return nil
	}
	return []string{"PYTHONPATH=" + boxpolicy.TemplatePython, "KILN_TEMPLATE_FILES=" + boxpolicy.TemplateDir}
}

// templateMountPoint makes the template's mount point in the synthesized
// host root (served read-only, so runsc could not make it). An image
// root (Options.Rootfs) must have it.
func templateMountPoint(root string) error {
	if err := os.MkdirAll(filepath.Join(root, boxpolicy.TemplateDir), 0o755); err != nil {
		return fmt.Errorf("building box root: %w", err)
	}
	return nil
}

// checkTemplateMountPoint refuses an image root without the template's
// mount point: runsc cannot make it in a read-only root.
func checkTemplateMountPoint(root string) error {
	st, err := os.Stat(filepath.Join(root, boxpolicy.TemplateDir))
	if err != nil || !st.IsDir() {
		return fmt.Errorf("gvisor backend: the image root %s has no %s directory for the template's files", root, boxpolicy.TemplateDir)
	}
	return nil
}
