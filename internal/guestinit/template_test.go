package guestinit

import "testing"

// TestTemplateDevice: only a kiln.template word before "--" naming a
// second-or-later virtio disk is taken; anything else is no template.
func TestTemplateDevice(t *testing.T) {
	for cmdline, want := range map[string]string{
		"ro kiln.template=/dev/vdb -- -guest":   "/dev/vdb",
		"ro kiln.template=/dev/vdc":             "/dev/vdc",
		"ro -- kiln.template=/dev/vdb":          "",
		"kiln.template=/dev/vda":                "",
		"kiln.template=/dev/sda":                "",
		"kiln.template=/dev/vdb/../../etc/x":    "",
		"kiln.template=":                        "",
		"ro quiet":                              "",
		"kiln.templatex=/dev/vdb":               "",
		"kiln.template=/dev/vdB kiln.template=": "",
	} {
		if got := templateDevice(cmdline); got != want {
			t.Errorf("templateDevice(%q) = %q, want %q", cmdline, got, want)
		}
	}
}
