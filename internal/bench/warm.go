package bench

import (
	"context"
	"fmt"
	"regexp"
	"strconv"
	"strings"
	"time"

	"github.com/modelcontextprotocol/go-sdk/mcp"
)

// startWarm starts a server and waits until its boxes come from its
// template (see warm).
func (r *runner) startWarm(ctx context.Context, mode string, pool int) (*server, error) {
	srv, err := r.startServer(ctx, mode, pool)
	if err != nil {
		return nil, err
	}
	if err := r.warm(ctx, srv, mode); err != nil {
		srv.close()
		return nil, fmt.Errorf("waiting for the server to warm up: %w", err)
	}
	return srv, nil
}

const (
	modulesCode = "import sys; print(len(sys.modules))"
	// warmQuiet is how long the count of a fresh box's modules must stay
	// that of the first box before the bench takes it that no preload
	// adds any.
	warmQuiet = 10 * time.Second
)

var modulesRe = regexp.MustCompile(`(?m)^(\d+)\s*$`)

// warm waits until a server's fresh boxes come from its warm template,
// where its backend has one. A call that arrives while a template is
// still warming may get a plain box without the preloads (the jail's
// early boxes, for cold start), which is not what the other rows measure.
// It counts the modules imported in fresh boxes until the count grows
// past the first box's, or stays the same for warmQuiet (nothing to
// preload, or no template).
func (r *runner) warm(ctx context.Context, srv *server, mode string) error {
	if preloadsNone(r.opts.ServerArgs) {
		_, err := srv.call(ctx, "run_python", runPython(printCode, ""), printWant)
		return err
	}
	r.progress("  waiting for the server's template to warm up")
	probe := func(i int) (int, error) {
		session := ""
		if mode == "session" {
			session = fmt.Sprintf("warm-%d", i)
		}
		res, err := srv.cs.CallTool(ctx, &mcp.CallToolParams{Name: "run_python", Arguments: runPython(modulesCode, session)})
		if err != nil {
			return 0, err
		}
		if session != "" {
			if _, err := srv.call(ctx, "reset_session", map[string]any{"session": session}, ""); err != nil {
				return 0, err
			}
		}
		m := modulesRe.FindStringSubmatch(resultText(res))
		if res.IsError || m == nil {
			return 0, fmt.Errorf("counting modules: %q", resultText(res))
		}
		return strconv.Atoi(m[1])
	}
	first, err := probe(0)
	if err != nil {
		return err
	}
	quiet := time.Now().Add(warmQuiet)
	for i := 1; time.Now().Before(quiet); i++ {
		if err := sleep(ctx, 500*time.Millisecond); err != nil {
			return err
		}
		n, err := probe(i)
		if err != nil {
			return err
		}
		if n > first {
			return nil
		}
	}
	return nil
}

// preloadsNone says whether the server arguments turn preloading off.
func preloadsNone(args []string) bool {
	none := false
	for i, a := range args {
		switch {
		case (a == "--preload" || a == "-preload") && i+1 < len(args):
			none = strings.TrimSpace(args[i+1]) == ""
		case strings.HasPrefix(a, "--preload="), strings.HasPrefix(a, "-preload="):
			none = strings.TrimSpace(a[strings.Index(a, "=")+1:]) == ""
		}
	}
	return none
}
