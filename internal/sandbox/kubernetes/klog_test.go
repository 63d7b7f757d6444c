package kubernetes

import (
	"bytes"
	"log/slog"
	"strings"
	"testing"

	"k8s.io/klog/v2"
)

// TestKlogGoesToSlog: what client-go logs through klog reaches the
// backend's slog logger (errors as warnings), never stderr on its own.
func TestKlogGoesToSlog(t *testing.T) {
	var buf bytes.Buffer
	routeKlog(slog.New(slog.NewTextHandler(&buf, nil)))
	t.Cleanup(func() { routeKlog(slog.New(slog.DiscardHandler)) })
	klog.ErrorS(nil, "Copying stdout failed", "logger", "UnhandledError")
	klog.Background().WithValues("k", "v").Info("from a contextual logger")
	klog.Flush()
	out := buf.String()
	for _, want := range []string{`level=WARN msg="Copying stdout failed"`, "component=client-go", `msg="from a contextual logger"`, "k=v"} {
		if !strings.Contains(out, want) {
			t.Errorf("slog got %q, want %s in it", out, want)
		}
	}
}
