package kubernetes

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/url"
	"sync"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/remotecommand"
	"k8s.io/streaming/pkg/httpstream"

	"kiln/internal/agentproto"
)

// attachStream is the agent's stdin and stdout through one attach to its
// container: what kiln writes goes to the agent's stdin, what the agent
// writes on stdout comes back. Its stderr (the agent's log) goes to the
// logger, line by line, bounded.
type attachStream struct {
	out    *io.PipeReader // the agent's stdout
	in     *io.PipeWriter // the agent's stdin
	cancel context.CancelFunc
	done   chan struct{}
	once   sync.Once
}

// maxLogLine bounds one line of the agent's stderr in kiln's log: it comes
// out of the box.
const maxLogLine = 4096

// attach opens the stream to pod's container. It returns once the stream
// is being set up; a failure shows as an end of the stream.
func attach(cs kubernetes.Interface, cfg *rest.Config, pod *corev1.Pod, log *slog.Logger) (*attachStream, error) {
	req := cs.CoreV1().RESTClient().Post().Resource("pods").Name(pod.Name).Namespace(pod.Namespace).
		SubResource("attach").VersionedParams(&corev1.PodAttachOptions{
		Container: ContainerName, Stdin: true, Stdout: true, Stderr: true, TTY: false,
	}, scheme.ParameterCodec)
	exec, err := newExecutor(cfg, req.URL())
	if err != nil {
		return nil, err
	}
	inR, inW := io.Pipe()
	outR, outW := io.Pipe()
	ctx, cancel := context.WithCancel(context.Background())
	s := &attachStream{out: outR, in: inW, cancel: cancel, done: make(chan struct{})}
	logw := &lineLogger{log: log.With("pod", pod.Name)}
	go func() {
		defer close(s.done)
		err := exec.StreamWithContext(ctx, remotecommand.StreamOptions{Stdin: inR, Stdout: outW, Stderr: logw})
		if err == nil {
			err = io.EOF
		} else if ctx.Err() == nil {
			log.Debug("attach stream ended", "pod", pod.Name, "err", err)
		}
		outW.CloseWithError(err)
		inR.CloseWithError(io.ErrClosedPipe)
	}()
	return s, nil
}

// newExecutor is kubectl's choice: WebSockets, falling back to SPDY when the
// API server cannot upgrade to them.
func newExecutor(cfg *rest.Config, u *url.URL) (remotecommand.Executor, error) {
	ws, err := remotecommand.NewWebSocketExecutor(cfg, http.MethodGet, u.String())
	if err != nil {
		return nil, fmt.Errorf("attaching over websockets: %w", err)
	}
	sp, err := remotecommand.NewSPDYExecutor(cfg, http.MethodPost, u)
	if err != nil {
		return nil, fmt.Errorf("attaching over SPDY: %w", err)
	}
	return remotecommand.NewFallbackExecutor(ws, sp, func(err error) bool {
		return httpstream.IsUpgradeFailure(err) || httpstream.IsHTTPSProxyError(err)
	})
}

// maxSkip bounds the frames greet skips before the agent's hello: what a
// previous host's calls were still sending when the agent saw the marker.
const maxSkip = 4096

// greet begins this host's turn on the agent's stream (the agent serves
// hosts one after another, -await-host): it writes agentproto.AttachMarker
// and returns the stream positioned at the agent's hello, skipping the
// frames before it, which answer an earlier host. If ctx ends first, the
// stream is closed.
func greet(ctx context.Context, s *attachStream) (io.ReadWriteCloser, error) {
	type result struct {
		hello []byte
		err   error
	}
	ch := make(chan result, 1)
	go func() {
		if _, err := s.Write(agentproto.AttachMarker); err != nil {
			ch <- result{err: err}
			return
		}
		for range maxSkip {
			var f map[string]json.RawMessage
			if err := agentproto.ReadFrame(s, &f); err != nil {
				ch <- result{err: err}
				return
			}
			if f["version"] != nil && f["id"] == nil {
				var buf bytes.Buffer
				err := agentproto.WriteFrame(&buf, f)
				ch <- result{hello: buf.Bytes(), err: err}
				return
			}
		}
		ch <- result{err: fmt.Errorf("no hello in %d frames", maxSkip)}
	}()
	select {
	case r := <-ch:
		if r.err != nil {
			s.Close()
			return nil, fmt.Errorf("greeting the agent: %w", r.err)
		}
		return &greeted{Reader: io.MultiReader(bytes.NewReader(r.hello), s), attachStream: s}, nil
	case <-ctx.Done():
		s.Close()
		<-ch
		return nil, fmt.Errorf("greeting the agent: %w", ctx.Err())
	}
}

// greeted is an attach stream whose first bytes, the agent's hello, were
// read once already.
type greeted struct {
	io.Reader
	*attachStream
}

func (g *greeted) Read(p []byte) (int, error) { return g.Reader.Read(p) }

func (s *attachStream) Read(p []byte) (int, error)  { return s.out.Read(p) }
func (s *attachStream) Write(p []byte) (int, error) { return s.in.Write(p) }

// Close ends the attach. It does not stop the box: the Pod's deletion does.
func (s *attachStream) Close() error {
	s.once.Do(func() {
		s.cancel()
		s.in.Close()
		s.out.Close()
	})
	<-s.done
	return nil
}

// lineLogger logs what it is given line by line at debug level, each line
// cut at maxLogLine.
type lineLogger struct {
	log *slog.Logger
	mu  sync.Mutex
	buf []byte
}

func (l *lineLogger) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := len(p)
	for len(p) > 0 {
		i := bytes.IndexByte(p, '\n')
		chunk := p
		if i >= 0 {
			chunk = p[:i]
		}
		if room := maxLogLine - len(l.buf); room > 0 {
			l.buf = append(l.buf, chunk[:min(len(chunk), room)]...)
		}
		if i < 0 {
			break
		}
		l.log.Debug("agent", "line", string(l.buf))
		l.buf = l.buf[:0]
		p = p[i+1:]
	}
	return n, nil
}
