package guestinit

import (
	"strings"

	"kiln/internal/boxpolicy"
)

// TemplateParam is the kernel command-line word (TemplateParam=DEVICE)
// by which the host gives the guest a configured template's files: a
// read-only ext4 disk labelled TemplateLabel, which stage 2 mounts at
// boxpolicy.TemplateDir, read-only, nosuid and nodev, and puts its python
// directory on the agent's (so the code's) PYTHONPATH.
const TemplateParam = "kiln.template"

// TemplateLabel is the ext4 volume label of a template disk; stage 2
// refuses a device without it (a root disk given by mistake).
const TemplateLabel = "kiln-template"

// TemplateEnv is the environment the code finds with a template, as on
// the jail and gVisor.
var TemplateEnv = []string{"PYTHONPATH=" + boxpolicy.TemplatePython, "KILN_TEMPLATE_FILES=" + boxpolicy.TemplateDir}

// templateEnv is the environment a template adds, if cmdline names one.
func templateEnv(cmdline string) []string {
	if templateDevice(cmdline) == "" {
		return nil
	}
	return TemplateEnv
}

// templateDevice is the template device the command line names: a
// /dev/vdX path, or "" for none (or anything else).
func templateDevice(cmdline string) string {
	for _, w := range strings.Fields(cmdline) {
		if w == "--" {
			break
		}
		k, v, ok := strings.Cut(w, "=")
		if !ok || k != TemplateParam {
			continue
		}
		if len(v) == len("/dev/vdb") && strings.HasPrefix(v, "/dev/vd") && v[7] >= 'b' && v[7] <= 'z' {
			return v
		}
	}
	return ""
}
