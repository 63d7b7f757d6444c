package mcpserver

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"path"
	"strconv"
	"strings"
	"sync"
	"time"
	"unicode/utf8"

	"github.com/modelcontextprotocol/go-sdk/mcp"
	"golang.org/x/sync/semaphore"

	"kiln/internal/agentproto"
	"kiln/internal/sandbox"
	"kiln/internal/session"
)

// Results as resources. What is too big to inline in a tool result — an
// image or a produced file over ResourceOptions.InlineBytes, the part of
// stdout or stderr the result does not show — comes back as a
// resource_link block to a kiln:// URI, next to a line of text that names
// it (for clients that do not follow links), and resources/read serves it:
//
//	kiln://<session>/files/<path>         a workspace file, read live through the box's agent
//	kiln://<session>/calls/<n>/stdout     what a call printed, as the server kept it
//	kiln://<session>/calls/<n>/stderr
//	kiln://<session>/calls/<n>/<name>     an image the call displayed (display-1.png, …)
//	kiln://per-call/calls/<n>/files/<p>   a file a per-call run produced
//
// A URI names no principal: the reader's principal comes from the
// request's authentication (the bearer token over HTTP, "local" over
// stdio), and a URI only ever resolves among that principal's sessions
// and calls. Another principal's URI reads as "not found", exactly like
// one that never existed.
//
// The server holds a call's outputs, bounded in bytes per principal and in
// all, evicted oldest first, and drops them with their session or after
// the TTL. Workspace files are not held: they are read from the box when
// asked for, so they live exactly as long as the session's box.

// ResourceOptions configure results as resources. Zero values mean the
// defaults below.
type ResourceOptions struct {
	// InlineBytes: images and files larger than this come back as links.
	InlineBytes int
	// InlineOutput is the bytes of stdout and of stderr a result shows
	// (head and tail); what the session kept beyond it (its MaxOutput) is
	// served as a resource. 0: show all that was kept.
	InlineOutput int
	// MaxBytes bounds the call outputs the server holds in all;
	// MaxBytesPerPrincipal those of one principal.
	MaxBytes, MaxBytesPerPrincipal int64
	// TTL is how long a call's outputs are kept at most.
	TTL time.Duration
}

// Defaults of ResourceOptions; kiln's flags default to them too.
const (
	DefaultInlineBytes          = 256 << 10
	DefaultResourceBytes        = 256 << 20
	DefaultResourceBytesPerUser = 64 << 20
	DefaultResourceTTL          = time.Hour
	// DefaultKeepOutput is the bytes of stdout and of stderr kiln asks the
	// box to keep per call (head and tail) by default, so that the part a
	// result does not show can be read as a resource.
	DefaultKeepOutput = 4 << 20
)

// Bounds of resources/read.
const (
	// maxResourceRead is the largest workspace file resources/read
	// serves: the largest write_file may create. It is read in pieces of
	// readChunk.
	maxResourceRead = 32 << 20
	// bigRead is where a read starts to count against readBudget.
	bigRead = 1 << 20
	// readBudget bounds the file bytes being read out of boxes (and of
	// held outputs being answered) at once: one of the largest reads, or
	// a few smaller ones; a read waits for its share. It does not cover
	// what follows the handler: the SDK encodes the result (base64, the
	// JSON-RPC frame, the transport's copy) after it returns, so a 20 MiB
	// read peaks kiln at about 190 MiB, four at once at about 380 MiB
	// (docs/tools.md, "Results as resources").
	readBudget = maxResourceRead
	// readChunk is the piece of a file one agent read carries: smaller
	// than agentproto.MaxRead, so the frames it arrives in stay small
	// next to the file.
	readChunk = 4 << 20
	// maxResourceItems bounds the entries the store holds, whatever
	// their size (a file link holds no bytes).
	maxResourceItems = 4096
	// maxItemsPerPrincipal bounds those of one principal, so that one
	// reading many files does not push out what others hold.
	maxItemsPerPrincipal = 512
	perCallHost          = "per-call"
)

func (o *ResourceOptions) defaults() {
	if o.InlineBytes <= 0 {
		o.InlineBytes = DefaultInlineBytes
	}
	if o.MaxBytes <= 0 {
		o.MaxBytes = DefaultResourceBytes
	}
	if o.MaxBytesPerPrincipal <= 0 {
		o.MaxBytesPerPrincipal = min(DefaultResourceBytesPerUser, o.MaxBytes)
	}
	if o.TTL <= 0 {
		o.TTL = DefaultResourceTTL
	}
}

// resItem is one resource the server knows of: a call's output it holds
// (data), or a workspace file it linked to (no data; read live).
type resItem struct {
	uri, principal, session string
	sess                    *session.Session // nil in per-call mode
	name, mime              string
	size                    int64
	data                    []byte
	held                    bool // data is the server's to serve
	added                   time.Time
}

// resKey names an item: a URI names no principal, and two principals'
// sessions of the same name have the same file URIs, so the principal is
// part of the key.
type resKey struct{ principal, uri string }

func (it *resItem) key() resKey { return resKey{it.principal, it.uri} }

// resStore holds the principal-scoped resources of one server.
type resStore struct {
	opts ResourceOptions
	mgr  *session.Manager
	now  func() time.Time

	mu    sync.Mutex
	calls uint64              // the last call number given out
	items map[resKey]*resItem // by principal and URI
	order []*resItem          // oldest first; may hold removed items
	used  map[string]int64    // held bytes per principal
	count map[string]int      // items per principal
	total int64               // held bytes in all
	reads *semaphore.Weighted // readBudget
}

func newResStore(mgr *session.Manager, opts ResourceOptions) *resStore {
	opts.defaults()
	return &resStore{opts: opts, mgr: mgr, now: time.Now, items: map[resKey]*resItem{}, used: map[string]int64{}, count: map[string]int{},
		reads: semaphore.NewWeighted(readBudget)}
}

// nextCall gives out a call number, unique for the server's life, so a
// URI never names a different call after its session is gone.
func (st *resStore) nextCall() uint64 {
	st.mu.Lock()
	defer st.mu.Unlock()
	st.calls++
	return st.calls
}

// alive reports whether it is within its TTL and its session is still the
// one it was made in.
func (st *resStore) alive(it *resItem, now time.Time) bool {
	if it.held && now.Sub(it.added) > st.opts.TTL {
		return false
	}
	if it.sess == nil {
		return true // per-call mode: no session to die with
	}
	s, ok := st.mgr.Lookup(it.principal, it.session)
	return ok && s == it.sess
}

// sweepLocked drops what died (TTL, its session) and compacts order.
func (st *resStore) sweepLocked() {
	now := st.now()
	kept := st.order[:0]
	for _, it := range st.order {
		if st.items[it.key()] != it {
			continue
		}
		if !st.alive(it, now) {
			st.dropLocked(it)
			continue
		}
		kept = append(kept, it)
	}
	clear(st.order[len(kept):])
	st.order = kept
}

func (st *resStore) dropLocked(it *resItem) {
	if st.items[it.key()] != it {
		return
	}
	delete(st.items, it.key())
	if st.count[it.principal]--; st.count[it.principal] <= 0 {
		delete(st.count, it.principal)
	}
	if it.held {
		st.used[it.principal] -= int64(len(it.data))
		if st.used[it.principal] == 0 {
			delete(st.used, it.principal)
		}
		st.total -= int64(len(it.data))
	}
}

// put adds it, evicting the oldest items of its principal and then of
// everyone until it fits. It reports false, holding nothing, when it can
// never fit.
func (st *resStore) put(it *resItem) bool {
	n := int64(len(it.data))
	if it.held && (n > st.opts.MaxBytesPerPrincipal || n > st.opts.MaxBytes) {
		return false
	}
	it.added = st.now()
	st.mu.Lock()
	defer st.mu.Unlock()
	st.sweepLocked()
	if old := st.items[it.key()]; old != nil {
		st.dropLocked(old)
	}
	for _, it2 := range st.order {
		if (!it.held || st.used[it.principal]+n <= st.opts.MaxBytesPerPrincipal) && st.count[it.principal] < maxItemsPerPrincipal {
			break
		}
		if it2.principal == it.principal {
			st.dropLocked(it2)
		}
	}
	for _, it2 := range st.order {
		if (!it.held || st.total+n <= st.opts.MaxBytes) && len(st.items) < maxResourceItems {
			break
		}
		st.dropLocked(it2)
	}
	st.items[it.key()] = it
	st.order = append(st.order, it)
	st.count[it.principal]++
	if it.held {
		st.used[it.principal] += n
		st.total += n
	}
	return true
}

// get returns the principal's live item at uri.
func (st *resStore) get(principal, uri string) *resItem {
	st.mu.Lock()
	defer st.mu.Unlock()
	it := st.items[resKey{principal, uri}]
	if it == nil {
		return nil
	}
	if !st.alive(it, st.now()) {
		st.dropLocked(it)
		return nil
	}
	return it
}

// list returns the principal's live items, newest first.
func (st *resStore) list(principal string) []*resItem {
	st.mu.Lock()
	defer st.mu.Unlock()
	st.sweepLocked()
	var out []*resItem
	for i := len(st.order) - 1; i >= 0; i-- {
		if it := st.order[i]; it.principal == principal {
			out = append(out, it)
		}
	}
	return out
}

// heldBytes reports the bytes held for principal and in all.
func (st *resStore) heldBytes(principal string) (int64, int64) {
	st.mu.Lock()
	defer st.mu.Unlock()
	return st.used[principal], st.total
}

// callURI is the URI of name among call n's outputs.
func callURI(sessionName string, n uint64, name string) string {
	return (&url.URL{Scheme: "kiln", Host: hostOf(sessionName), Path: "/calls/" + strconv.FormatUint(n, 10) + "/" + name}).String()
}

// fileURI is the URI of a workspace file of a session.
func fileURI(sessionName, p string) string {
	return (&url.URL{Scheme: "kiln", Host: sessionName, Path: "/files/" + strings.TrimPrefix(path.Clean("/"+p), "/")}).String()
}

func hostOf(sessionName string) string {
	if sessionName == "" {
		return perCallHost
	}
	return sessionName
}

// principalOf identifies the caller of any request: the token's user over
// HTTP, "local" over stdio.
func principalOf(extra *mcp.RequestExtra) string {
	if extra != nil && extra.TokenInfo != nil && extra.TokenInfo.UserID != "" {
		return extra.TokenInfo.UserID
	}
	return localPrincipal
}

// localPrincipal is the principal of clients without a token: stdio, and
// HTTP on loopback without authentication. No token may name it.
const localPrincipal = "local"

// callLinks files one call's outputs as resources while its result is
// rendered. A nil *callLinks files nothing: everything is inlined as
// before.
type callLinks struct {
	st        *resStore
	principal string
	session   string
	sess      *session.Session
	n         uint64 // 0 until the first output is filed
}

func (s *Server) linksFor(req *mcp.CallToolRequest, sessionName string) *callLinks {
	if s.res == nil || req == nil {
		return nil
	}
	l := &callLinks{st: s.res, principal: principalOf(req.Extra), session: sessionName}
	if sessionName != "" {
		sess, ok := s.mgr.Lookup(l.principal, sessionName)
		if !ok {
			return nil // reset while the call ended: nothing would outlive it
		}
		l.sess = sess
	}
	return l
}

// hold files data as the call's output name and returns its link, or nil
// when the server cannot hold it.
func (l *callLinks) hold(name, mime string, data []byte) *mcp.ResourceLink {
	if l == nil {
		return nil
	}
	if l.n == 0 {
		l.n = l.st.nextCall()
	}
	it := &resItem{uri: callURI(l.session, l.n, name), principal: l.principal, session: hostOf(l.session), sess: l.sess,
		name: name, mime: mime, size: int64(len(data)), data: data, held: true}
	if !l.st.put(it) {
		return nil
	}
	return it.link()
}

// linkFile files a link to a workspace file of a session (nothing held).
func (st *resStore) linkFile(principal string, sess *session.Session, p, mime string, size int64) *mcp.ResourceLink {
	it := &resItem{uri: fileURI(sess.Name(), p), principal: principal, session: sess.Name(), sess: sess,
		name: path.Base(p), mime: mime, size: size}
	st.put(it)
	return it.link()
}

func (it *resItem) link() *mcp.ResourceLink {
	size := it.size
	return &mcp.ResourceLink{URI: it.uri, Name: it.name, MIMEType: it.mime, Size: &size,
		Description: fmt.Sprintf("%d bytes; read it with resources/read", it.size)}
}

// summary is the line of text that stands for a link, for clients that do
// not follow links.
func summary(what string, l *mcp.ResourceLink) string {
	return fmt.Sprintf("%s (%d bytes, %s) is at %s (resources/read)", what, *l.Size, l.MIMEType, l.URI)
}

// mimeOf guesses a file's type from its content and name.
func mimeOf(p string, data []byte) string {
	if m := imageMIME(p, data); m != "" {
		return m
	}
	switch path.Ext(p) {
	case ".json":
		return "application/json"
	case ".csv":
		return "text/csv"
	case ".html", ".htm":
		return "text/html"
	case ".svg":
		return "image/svg+xml"
	}
	if data != nil && utf8.Valid(data) && !strings.ContainsRune(string(data), 0) {
		return "text/plain"
	}
	return "application/octet-stream"
}

// addResources registers the kiln:// templates and serves resources/list
// for the caller's principal.
func (s *Server) addResources() {
	if !s.perCall() {
		s.mcp.AddResourceTemplate(&mcp.ResourceTemplate{
			URITemplate: "kiln://{session}/files/{+path}",
			Name:        "workspace file",
			Title:       "A file in a session's workspace",
			Description: "A file under " + workspace + " in one of your sessions, read from its sandbox when asked for (same path rules as read_file). Exists while the session's sandbox does.",
		}, s.readFileResource)
	}
	s.mcp.AddResourceTemplate(&mcp.ResourceTemplate{
		URITemplate: "kiln://{session}/calls/{call}/{+name}",
		Name:        "call output",
		Title:       "What one call produced",
		Description: fmt.Sprintf("The full stdout or stderr of a call whose result was cut, an image it displayed or a file it produced (per-call mode). Held by the server for at most %s and while the session lives, oldest dropped first beyond %d MiB per client.", s.res.opts.TTL, s.res.opts.MaxBytesPerPrincipal>>20),
	}, s.readCallResource)
	s.mcp.AddReceivingMiddleware(func(next mcp.MethodHandler) mcp.MethodHandler {
		return func(ctx context.Context, method string, req mcp.Request) (mcp.Result, error) {
			if method != "resources/list" {
				return next(ctx, method, req)
			}
			return s.listResources(req.GetExtra()), nil
		}
	})
}

// listResources lists the caller's resources kiln announced, newest first.
// Workspace files are listed once a result linked them; the template
// reaches any other.
func (s *Server) listResources(extra *mcp.RequestExtra) *mcp.ListResourcesResult {
	// What one principal sees is theirs alone, and changes with every
	// call: private, and stale at once.
	res := &mcp.ListResourcesResult{Resources: []*mcp.Resource{}, Cacheable: private}
	for _, it := range s.res.list(principalOf(extra)) {
		res.Resources = append(res.Resources, &mcp.Resource{URI: it.uri, Name: it.name, MIMEType: it.mime, Size: it.size,
			Description: fmt.Sprintf("%d bytes", it.size)})
		if len(res.Resources) >= 1000 {
			break
		}
	}
	return res
}

func (s *Server) readCallResource(ctx context.Context, req *mcp.ReadResourceRequest) (*mcp.ReadResourceResult, error) {
	uri := req.Params.URI
	it := s.res.get(principalOf(req.Extra), uri)
	if it == nil || !it.held {
		return nil, mcp.ResourceNotFoundError(uri)
	}
	if n := int64(len(it.data)); n > bigRead {
		if err := s.res.reads.Acquire(ctx, n); err != nil {
			return nil, err
		}
		defer s.res.reads.Release(n)
	}
	return contents(uri, it.mime, it.data), nil
}

// contents is a resource's body: text when it is text, a blob otherwise.
func contents(uri, mime string, data []byte) *mcp.ReadResourceResult {
	c := &mcp.ResourceContents{URI: uri, MIMEType: mime}
	if strings.HasPrefix(mime, "text/") && utf8.Valid(data) {
		c.Text = string(data)
	} else {
		c.Blob = data
		if c.Blob == nil {
			c.Blob = []byte{}
		}
	}
	return &mcp.ReadResourceResult{Contents: []*mcp.ResourceContents{c}, Cacheable: private}
}

// private is the caching hint of what kiln serves a principal: for that
// principal's client alone, stale at once (a workspace file changes with
// the next call).
var private = mcp.Cacheable{TTLMs: 0, CacheScope: "private"}

// errResource is a resource kiln could not read, for the client.
func errResource(uri string, err error) error {
	return &resourceError{uri: uri, err: err}
}

type resourceError struct {
	uri string
	err error
}

func (e *resourceError) Error() string { return fmt.Sprintf("reading %s: %v", e.uri, e.err) }
func (e *resourceError) Unwrap() error { return e.err }

func (s *Server) readFileResource(ctx context.Context, req *mcp.ReadResourceRequest) (*mcp.ReadResourceResult, error) {
	uri := req.Params.URI
	u, err := url.Parse(uri)
	if err != nil || u.Scheme != "kiln" || u.User != nil || u.Fragment != "" {
		return nil, mcp.ResourceNotFoundError(uri)
	}
	part, perr := parsePart(u.RawQuery)
	if perr != nil {
		return nil, errResource(uri, perr)
	}
	p, ok := strings.CutPrefix(u.Path, "/files/")
	if !ok || p == "" || !session.ValidName(u.Host) {
		return nil, mcp.ResourceNotFoundError(uri)
	}
	sess, ok := s.mgr.Lookup(principalOf(req.Extra), u.Host)
	if !ok {
		return nil, mcp.ResourceNotFoundError(uri)
	}
	var (
		data []byte
		size int64
	)
	err = sess.WithLiveBox(ctx, func(box sandbox.Sandbox) (err error) {
		if part != nil {
			if err := s.res.reads.Acquire(ctx, part.n); err != nil {
				return err
			}
			defer s.res.reads.Release(part.n)
			data, size, err = readPart(ctx, box, p, part.off, part.n)
			return err
		}
		data, err = s.readWhole(ctx, box, p)
		return err
	})
	switch {
	case errors.Is(err, session.ErrNoBox):
		return nil, mcp.ResourceNotFoundError(uri)
	case err != nil:
		// The agent's reason (no such file, outside the workspace) is
		// about the caller's own session.
		return nil, errResource(uri, err)
	}
	if part != nil {
		// A part is bytes, whatever the file: a cut may split a character.
		c := &mcp.ResourceContents{URI: uri, MIMEType: "application/octet-stream", Blob: data,
			Meta: mcp.Meta{"kiln/offset": part.off, "kiln/size": size}}
		if c.Blob == nil {
			c.Blob = []byte{}
		}
		return &mcp.ReadResourceResult{Contents: []*mcp.ResourceContents{c}, Cacheable: private}, nil
	}
	return contents(uri, mimeOf(p, data), data), nil
}

// maxPart is the most one part of a file read carries: 8 MiB is about
// 11 MiB of base64, under the 16 MiB a message that the Go SDK's clients
// take by default.
const maxPart = 8 << 20

type filePart struct{ off, n int64 }

// parsePart reads "offset=N&length=M" (length at most maxPart, default
// maxPart); an empty query is the whole file (nil).
func parsePart(query string) (*filePart, error) {
	if query == "" {
		return nil, nil
	}
	q, err := url.ParseQuery(query)
	if err != nil {
		return nil, fmt.Errorf("query: %v", err)
	}
	part := &filePart{n: maxPart}
	for k, v := range q {
		if len(v) != 1 {
			return nil, fmt.Errorf("query: %q given %d times", k, len(v))
		}
		n, err := strconv.ParseInt(v[0], 10, 64)
		if err != nil || n < 0 {
			return nil, fmt.Errorf("query: %s=%q is not a byte count", k, v[0])
		}
		switch k {
		case "offset":
			part.off = n
		case "length":
			if n == 0 || n > maxPart {
				return nil, fmt.Errorf("query: length must be 1 to %d", maxPart)
			}
			part.n = n
		default:
			return nil, fmt.Errorf("query: unknown parameter %q (offset and length are known)", k)
		}
	}
	return part, nil
}

// readPart reads at most n bytes of a workspace file from off, and the
// file's size.
func readPart(ctx context.Context, box sandbox.Sandbox, p string, off, n int64) ([]byte, int64, error) {
	if off == 0 {
		return box.ReadFile(ctx, p, n)
	}
	rr, ok := box.(sandbox.RangeReader)
	if !ok {
		return nil, 0, sandbox.ErrNoRangedRead
	}
	return rr.ReadFileAt(ctx, p, off, n)
}

// readWhole reads a workspace file of up to maxResourceRead bytes, in
// pieces of readChunk, under the budget of big reads. A file
// that changes size while it is read is an error, not a mix of two
// versions of it.
func (s *Server) readWhole(ctx context.Context, box sandbox.Sandbox, p string) ([]byte, error) {
	head, size, err := box.ReadFile(ctx, p, bigRead)
	if err != nil {
		return nil, err
	}
	switch {
	case size > maxResourceRead:
		return nil, fmt.Errorf("the file is %d bytes; resources/read serves at most %d MiB", size, maxResourceRead>>20)
	case int64(len(head)) == size:
		return head, nil
	case int64(len(head)) != bigRead:
		return nil, fmt.Errorf("the agent returned %d bytes of a %d byte file", len(head), size)
	}
	rr, ok := box.(sandbox.RangeReader)
	if !ok {
		return nil, fmt.Errorf("the file is %d bytes, and this sandbox reads at most %d MiB at once", size, agentproto.MaxRead>>20)
	}
	if err := s.res.reads.Acquire(ctx, size); err != nil {
		return nil, err
	}
	defer s.res.reads.Release(size)
	data := make([]byte, 0, size)
	data = append(data, head...)
	for int64(len(data)) < size {
		chunk, n, err := rr.ReadFileAt(ctx, p, int64(len(data)), min(readChunk, size-int64(len(data))))
		if err != nil {
			return nil, err
		}
		if n != size || len(chunk) == 0 {
			return nil, fmt.Errorf("the file changed while it was read (%d bytes, then %d)", size, n)
		}
		data = append(data, chunk...)
	}
	if int64(len(data)) != size {
		return nil, fmt.Errorf("the file changed while it was read")
	}
	return data, nil
}
