package jail

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"

	"golang.org/x/sys/unix"

	"kiln/internal/boxpolicy"
)

// A configured template (Options.Template, kiln template) is a host
// directory of files an operator's setup made: modules installed with pip
// --target into its python directory, data files. It is bound at
// boxpolicy.TemplateDir in every box. The zygote template binds it too,
// before its python imports the preloads, so a template's modules can be
// imported once and every fork shares their pages; forks inherit the
// bind, locked read-only in their own user namespace.
//
// Why a bind and not a snapshot: what a setup leaves behind is files, and
// a read-only bind of one directory costs a box nothing at start, is the
// same in a zygote fork and in a directly started box, needs no way to
// save a process, and cannot be changed by model code (the mount is
// read-only and locked, the files belong to the host's root, and Landlock
// grants the path read access only).

// prepareTemplate checks Options.Template and sets what it implies: the
// template's environment for every box, and no zygote while the setup
// writes into it.
func prepareTemplate(opts *Options) error {
	if opts.Template == "" {
		if opts.TemplateWritable {
			return fmt.Errorf("jail: TemplateWritable without a Template")
		}
		return nil
	}
	if !filepath.IsAbs(opts.Template) {
		return fmt.Errorf("jail: template directory %q is not an absolute path", opts.Template)
	}
	st, err := os.Stat(opts.Template)
	if err != nil {
		return fmt.Errorf("jail: template directory: %w", err)
	}
	if !st.IsDir() {
		return fmt.Errorf("jail: template directory %s is not a directory", opts.Template)
	}
	if opts.TemplateWritable {
		opts.Zygote = false
	}
	opts.Env = append(slices.Clone(opts.Env), templateEnv()...)
	return nil
}

// templateEnv is what a box with a template finds in its environment.
// (Not KILN_TEMPLATE: that is the server's --template, from its own
// environment.)
func templateEnv() []string {
	return []string{"PYTHONPATH=" + boxpolicy.TemplatePython, "KILN_TEMPLATE_FILES=" + boxpolicy.TemplateDir}
}

// withTemplate adds the template's Landlock rule to a box's plan: read
// beneath it, or read and write during the setup.
func (b *Backend) withTemplate(p boxpolicy.Plan) boxpolicy.Plan {
	if b.opts.Template == "" {
		return p
	}
	access := boxpolicy.ReadDir
	if b.opts.TemplateWritable {
		access = boxpolicy.ReadWriteDir
	}
	p.Landlock = append(slices.Clone(p.Landlock), boxpolicy.PathRule{Path: boxpolicy.TemplateDir, Access: access})
	return p
}

// bindTemplate binds the template's directory into the root being built,
// read-only (writable only for the setup), nosuid and nodev.
func bindTemplate(cfg *initConfig) error {
	if cfg.Template == "" {
		return nil
	}
	dst := filepath.Join(cfg.Root, boxpolicy.TemplateDir)
	if err := os.MkdirAll(dst, 0o755); err != nil {
		return err
	}
	if !cfg.TemplateRW {
		return bindRO(cfg.Template, dst)
	}
	if err := mount(cfg.Template, dst, "", unix.MS_BIND, ""); err != nil {
		return err
	}
	var st unix.Statfs_t
	if err := unix.Statfs(dst, &st); err != nil {
		return err
	}
	locked := uintptr(st.Flags) & (unix.MS_NOEXEC | unix.MS_NOATIME | unix.MS_NODIRATIME | unix.MS_RELATIME)
	return mount("", dst, "", unix.MS_BIND|unix.MS_REMOUNT|unix.MS_NOSUID|unix.MS_NODEV|locked, "")
}
