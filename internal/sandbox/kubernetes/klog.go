package kubernetes

import (
	"context"
	"log/slog"
	"slices"
	"sync"
	"sync/atomic"

	"k8s.io/klog/v2"
)

// client-go logs through klog, which writes to stderr on its own: an
// attach stream that ends as a box is deleted leaves "UnhandledError"
// lines there. routeKlog sends klog into the slog logger of the latest
// backend made instead (klog is one per process), as warnings at most:
// what client-go calls an error is a stream the backend already handles.
// With no backend logger, klog says nothing.

var (
	klogOnce   sync.Once
	klogLogger atomic.Pointer[slog.Logger]
)

func routeKlog(log *slog.Logger) {
	klogLogger.Store(log.With("component", "client-go"))
	klogOnce.Do(func() { klog.SetSlogLogger(slog.New(klogHandler{})) })
}

// klogHandler hands records to klogLogger's handler, at most at warning
// level, with the attributes and groups klog added, in their order.
type klogHandler struct {
	with []func(slog.Handler) slog.Handler
}

func (h klogHandler) handler() slog.Handler {
	l := klogLogger.Load()
	if l == nil {
		return slog.DiscardHandler
	}
	out := l.Handler()
	for _, w := range h.with {
		out = w(out)
	}
	return out
}

func (h klogHandler) Enabled(ctx context.Context, l slog.Level) bool {
	return h.handler().Enabled(ctx, min(l, slog.LevelWarn))
}

func (h klogHandler) Handle(ctx context.Context, r slog.Record) error {
	r.Level = min(r.Level, slog.LevelWarn)
	out := h.handler()
	if !out.Enabled(ctx, r.Level) {
		return nil
	}
	return out.Handle(ctx, r)
}

func (h klogHandler) WithAttrs(as []slog.Attr) slog.Handler {
	return klogHandler{append(slices.Clip(h.with), func(o slog.Handler) slog.Handler { return o.WithAttrs(as) })}
}

func (h klogHandler) WithGroup(name string) slog.Handler {
	return klogHandler{append(slices.Clip(h.with), func(o slog.Handler) slog.Handler { return o.WithGroup(name) })}
}
