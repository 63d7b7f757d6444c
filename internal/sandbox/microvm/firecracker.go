package microvm

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"time"

	"kiln/internal/egress"
	"kiln/internal/image"
)

// This file is the Firecracker driver's API client: Firecracker is
// configured and controlled through a REST API on a unix socket (its
// swagger spec, src/firecracker/swagger/firecracker.yaml in its
// repository). Firecracker needs KVM, which this project's development
// machine lacks: the client is tested against a fake server that checks
// every request against that spec (firecracker_test.go), never against a
// real Firecracker.

// FirecrackerOptions configure the Firecracker backend. Image and Kernel
// are required.
//
// Firecracker has no ACPI and no initramfs-friendly module loading here:
// it needs an uncompressed kernel (vmlinux) with virtio-mmio (and its
// command-line devices), virtio-blk, vsock and ext4 built in. Debian's kernel
// is not one; kiln image build does not make one yet.
type FirecrackerOptions struct {
	Image       *image.Image
	Kernel      string // vmlinux for Firecracker
	Firecracker string // binary; default "firecracker" from PATH
	StateDir    string // templates; default os.UserCacheDir()/kiln/firecracker
	RunDir      string // per-VM sockets; default os.TempDir()/kiln-firecracker-<pid>.<start>
	Cgroup      string
	NoCgroup    bool
	BootTimeout time.Duration // default 60s
	// Egress and Policy give every VM a network interface, as
	// Options.Egress does QEMU's: a tap in Firecracker's own network
	// namespace (host_dev_name TapName), bridged to the box's
	// attachment. Needs root.
	Egress *egress.Gateway
	Policy egress.Policy
	Logger *slog.Logger
}

// agentVsockPort is where guestinit's bridge listens in the guest.
const agentVsockPort = 1024

// fcClient talks to one Firecracker process.
type fcClient struct {
	http *http.Client
}

func newFCClient(socket string) *fcClient {
	return &fcClient{http: &http.Client{Transport: &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "unix", socket)
		},
		DisableKeepAlives: false,
		MaxIdleConns:      1,
	}}}
}

// fcError is the API's error body.
type fcError struct {
	Status  int
	Op      string
	Message string `json:"fault_message"`
}

func (e *fcError) Error() string {
	return fmt.Sprintf("firecracker %s: %d %s", e.Op, e.Status, e.Message)
}

// do sends one request; the host is a placeholder, the socket is the route.
func (c *fcClient) do(ctx context.Context, method, path string, body, result any) error {
	var rd io.Reader
	if body != nil {
		b, err := json.Marshal(body)
		if err != nil {
			return fmt.Errorf("encoding %s %s: %w", method, path, err)
		}
		rd = bytes.NewReader(b)
	}
	req, err := http.NewRequestWithContext(ctx, method, "http://localhost"+path, rd)
	if err != nil {
		return err
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	req.Header.Set("Accept", "application/json")
	resp, err := c.http.Do(req)
	if err != nil {
		return fmt.Errorf("calling firecracker %s %s: %w", method, path, err)
	}
	defer resp.Body.Close()
	data, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if resp.StatusCode >= 300 {
		e := &fcError{Status: resp.StatusCode, Op: method + " " + path}
		json.Unmarshal(data, e)
		if e.Message == "" {
			e.Message = strings.TrimSpace(string(data))
		}
		return e
	}
	if result != nil {
		if err := json.Unmarshal(data, result); err != nil {
			return fmt.Errorf("decoding firecracker %s %s: %w", method, path, err)
		}
	}
	return nil
}

// API bodies, named after the spec's definitions.

type fcMachineConfig struct {
	VcpuCount  int   `json:"vcpu_count"`
	MemSizeMiB int64 `json:"mem_size_mib"`
	SMT        bool  `json:"smt"`
}

type fcBootSource struct {
	KernelImagePath string `json:"kernel_image_path"`
	InitrdPath      string `json:"initrd_path,omitempty"`
	BootArgs        string `json:"boot_args,omitempty"`
}

type fcDrive struct {
	DriveID      string `json:"drive_id"`
	PathOnHost   string `json:"path_on_host"`
	IsRootDevice bool   `json:"is_root_device"`
	IsReadOnly   bool   `json:"is_read_only"`
}

// fcNetworkInterface is a guest NIC on a tap in Firecracker's namespace.
type fcNetworkInterface struct {
	IfaceID     string `json:"iface_id"`
	HostDevName string `json:"host_dev_name"`
	GuestMAC    string `json:"guest_mac,omitempty"`
}

type fcVsock struct {
	GuestCID int    `json:"guest_cid"`
	UDSPath  string `json:"uds_path"`
}

type fcMemBackend struct {
	BackendType string `json:"backend_type"` // "File" or "Uffd"
	BackendPath string `json:"backend_path"`
}

type fcSnapshotCreate struct {
	SnapshotType string `json:"snapshot_type,omitempty"`
	SnapshotPath string `json:"snapshot_path"`
	MemFilePath  string `json:"mem_file_path"`
}

type fcVsockOverride struct {
	UDSPath string `json:"uds_path"`
}

type fcSnapshotLoad struct {
	SnapshotPath  string           `json:"snapshot_path"`
	MemBackend    *fcMemBackend    `json:"mem_backend,omitempty"`
	ResumeVM      bool             `json:"resume_vm"`
	VsockOverride *fcVsockOverride `json:"vsock_override,omitempty"`
}

type fcInstanceInfo struct {
	ID         string `json:"id"`
	State      string `json:"state"`
	VMMVersion string `json:"vmm_version"`
	AppName    string `json:"app_name"`
}

func (c *fcClient) machineConfig(ctx context.Context, m fcMachineConfig) error {
	return c.do(ctx, http.MethodPut, "/machine-config", m, nil)
}

func (c *fcClient) bootSource(ctx context.Context, b fcBootSource) error {
	return c.do(ctx, http.MethodPut, "/boot-source", b, nil)
}

func (c *fcClient) drive(ctx context.Context, d fcDrive) error {
	return c.do(ctx, http.MethodPut, "/drives/"+d.DriveID, d, nil)
}

func (c *fcClient) networkInterface(ctx context.Context, n fcNetworkInterface) error {
	return c.do(ctx, http.MethodPut, "/network-interfaces/"+n.IfaceID, n, nil)
}

func (c *fcClient) vsock(ctx context.Context, v fcVsock) error {
	return c.do(ctx, http.MethodPut, "/vsock", v, nil)
}

func (c *fcClient) entropy(ctx context.Context) error {
	return c.do(ctx, http.MethodPut, "/entropy", struct{}{}, nil)
}

func (c *fcClient) action(ctx context.Context, typ string) error {
	return c.do(ctx, http.MethodPut, "/actions", map[string]string{"action_type": typ}, nil)
}

// setState pauses or resumes the VM ("Paused", "Resumed").
func (c *fcClient) setState(ctx context.Context, state string) error {
	return c.do(ctx, http.MethodPatch, "/vm", map[string]string{"state": state}, nil)
}

func (c *fcClient) createSnapshot(ctx context.Context, s fcSnapshotCreate) error {
	return c.do(ctx, http.MethodPut, "/snapshot/create", s, nil)
}

func (c *fcClient) loadSnapshot(ctx context.Context, s fcSnapshotLoad) error {
	return c.do(ctx, http.MethodPut, "/snapshot/load", s, nil)
}

func (c *fcClient) describe(ctx context.Context) (fcInstanceInfo, error) {
	var info fcInstanceInfo
	err := c.do(ctx, http.MethodGet, "/", nil, &info)
	return info, err
}

// waitReady polls the API socket until Firecracker answers.
func (c *fcClient) waitReady(ctx context.Context) error {
	for {
		if _, err := c.describe(ctx); err == nil {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("waiting for firecracker api: %w", ctx.Err())
		case <-time.After(5 * time.Millisecond):
		}
	}
}

// fcConnectVsock opens a host-initiated vsock connection through
// Firecracker's unix socket: "CONNECT <port>\n", answered "OK <n>\n".
func fcConnectVsock(ctx context.Context, udsPath string, port uint32) (net.Conn, error) {
	var d net.Dialer
	conn, err := d.DialContext(ctx, "unix", udsPath)
	if err != nil {
		return nil, fmt.Errorf("connecting vsock: %w", err)
	}
	stop := context.AfterFunc(ctx, func() { conn.Close() })
	defer stop()
	if _, err := fmt.Fprintf(conn, "CONNECT %d\n", port); err != nil {
		conn.Close()
		return nil, fmt.Errorf("connecting vsock: %w", err)
	}
	// Read the answer a byte at a time: what follows belongs to the agent.
	var line []byte
	b := make([]byte, 1)
	for len(line) < 64 {
		if _, err := conn.Read(b); err != nil {
			conn.Close()
			return nil, fmt.Errorf("connecting vsock: %w", err)
		}
		if b[0] == '\n' {
			break
		}
		line = append(line, b[0])
	}
	if !strings.HasPrefix(string(line), "OK ") {
		conn.Close()
		return nil, fmt.Errorf("connecting vsock port %d: %q", port, line)
	}
	return conn, nil
}
