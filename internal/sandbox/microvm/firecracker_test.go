package microvm

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/google/go-cmp/cmp"
)

// The Firecracker driver cannot run here (no usable KVM), so its client is
// checked against a fake Firecracker that validates every request against
// the published API spec: the operations kiln uses, transcribed from
// Firecracker's swagger 2.0 file (src/firecracker/swagger/firecracker.yaml,
// API version 1.x): paths, methods, required and allowed body properties
// with their types and enums, and the documented ordering rules (pre-boot
// only operations, snapshot/load only on a fresh process, snapshot/create
// only when paused).

type prop struct {
	typ      string // JSON type: string, integer, boolean, object, array
	enum     []string
	min, max float64 // integers; max 0 means unbounded
	obj      *schema
}

type schema struct {
	required []string
	props    map[string]prop
}

var (
	str     = prop{typ: "string"}
	boolean = prop{typ: "boolean"}
	integer = prop{typ: "integer"}
	object  = prop{typ: "object"}
	array   = prop{typ: "array"}
)

func enum(vals ...string) prop { return prop{typ: "string", enum: vals} }

// fcSpec maps "METHOD /path" (path parameters as {name}) to the body schema.
var fcSpec = map[string]*schema{
	"PUT /machine-config": {
		required: []string{"mem_size_mib", "vcpu_count"},
		props: map[string]prop{
			"cpu_template": enum("C3", "T2", "T2S", "T2CL", "T2A", "V1N1", "None"),
			"smt":          boolean, "mem_size_mib": integer, "track_dirty_pages": boolean,
			"vcpu_count": {typ: "integer", min: 1, max: 32},
			"huge_pages": enum("None", "Transparent", "2M"),
		},
	},
	"PUT /boot-source": {
		required: []string{"kernel_image_path"},
		props:    map[string]prop{"boot_args": str, "initrd_path": str, "kernel_image_path": str},
	},
	"PUT /drives/{drive_id}": {
		required: []string{"drive_id", "is_root_device"},
		props: map[string]prop{
			"drive_id": str, "partuuid": str, "is_root_device": boolean,
			"cache_type": enum("Unsafe", "Writeback"), "is_read_only": boolean,
			"path_on_host": str, "rate_limiter": object, "io_engine": enum("Sync", "Async"), "socket": str,
		},
	},
	"PUT /network-interfaces/{iface_id}": {
		required: []string{"iface_id", "host_dev_name"},
		props: map[string]prop{
			"iface_id": str, "host_dev_name": str, "guest_mac": str,
			"rx_rate_limiter": object, "tx_rate_limiter": object,
		},
	},
	"PUT /vsock": {
		required: []string{"guest_cid", "uds_path"},
		props:    map[string]prop{"guest_cid": {typ: "integer", min: 3}, "uds_path": str, "vsock_id": str},
	},
	"PUT /entropy": {props: map[string]prop{"rate_limiter": object}},
	"PUT /actions": {
		required: []string{"action_type"},
		props:    map[string]prop{"action_type": enum("FlushMetrics", "InstanceStart", "SendCtrlAltDel")},
	},
	"PATCH /vm": {
		required: []string{"state"},
		props:    map[string]prop{"state": enum("Paused", "Resumed")},
	},
	"PUT /snapshot/create": {
		required: []string{"mem_file_path", "snapshot_path"},
		props:    map[string]prop{"mem_file_path": str, "snapshot_path": str, "snapshot_type": enum("Full", "Diff")},
	},
	"PUT /snapshot/load": {
		required: []string{"snapshot_path"},
		props: map[string]prop{
			"enable_diff_snapshots": boolean, "track_dirty_pages": boolean, "mem_file_path": str,
			"mem_backend": {typ: "object", obj: &schema{
				required: []string{"backend_type", "backend_path"},
				props:    map[string]prop{"backend_type": enum("File", "Uffd"), "backend_path": str},
			}},
			"snapshot_path": str, "resume_vm": boolean, "network_overrides": array,
			"vsock_override": {typ: "object", obj: &schema{required: []string{"uds_path"}, props: map[string]prop{"uds_path": str}}},
			"clock_realtime": boolean,
		},
	},
	"GET /": nil,
}

// preBoot are the operations the spec allows only before InstanceStart.
var preBoot = []string{"PUT /machine-config", "PUT /boot-source", "PUT /drives/{drive_id}", "PUT /network-interfaces/{iface_id}", "PUT /vsock", "PUT /entropy"}

func jsonType(v any) string {
	switch v.(type) {
	case string:
		return "string"
	case float64:
		return "number"
	case bool:
		return "boolean"
	case map[string]any:
		return "object"
	case []any:
		return "array"
	}
	return "null"
}

func (s *schema) check(body map[string]any) error {
	for _, r := range s.required {
		if _, ok := body[r]; !ok {
			return fmt.Errorf("missing required property %q", r)
		}
	}
	for k, v := range body {
		p, ok := s.props[k]
		if !ok {
			return fmt.Errorf("property %q is not in the spec", k)
		}
		t := jsonType(v)
		if p.typ == "integer" {
			f, isNum := v.(float64)
			if !isNum || f != float64(int64(f)) {
				return fmt.Errorf("%q must be an integer, got %v", k, v)
			}
			if f < p.min || (p.max != 0 && f > p.max) {
				return fmt.Errorf("%q = %v out of range", k, f)
			}
			continue
		}
		if t != p.typ {
			return fmt.Errorf("%q must be %s, got %s", k, p.typ, t)
		}
		if p.enum != nil && !slices.Contains(p.enum, v.(string)) {
			return fmt.Errorf("%q = %q not in %v", k, v, p.enum)
		}
		if p.obj != nil {
			if err := p.obj.check(v.(map[string]any)); err != nil {
				return fmt.Errorf("%s: %w", k, err)
			}
		}
	}
	return nil
}

// fakeFirecracker serves the API on a unix socket, validating requests and
// keeping Firecracker's state machine.
type fakeFirecracker struct {
	errorf   func(format string, args ...any)
	mu       sync.Mutex
	calls    []string // "PUT /drives/{drive_id}" form
	bodies   []map[string]any
	state    string                                     // "Not started", "Running", "Paused"
	touched  bool                                       // any resource configured (snapshot/load must come first)
	hook     func(op string, body map[string]any) error // runs after a valid call
	failNext string                                     // make the next call to this operation fail
}

func (f *fakeFirecracker) route(method, path string) (string, map[string]string) {
	params := map[string]string{}
	if id, ok := strings.CutPrefix(path, "/drives/"); ok {
		params["drive_id"] = id
		path = "/drives/{drive_id}"
	}
	if id, ok := strings.CutPrefix(path, "/network-interfaces/"); ok {
		params["iface_id"] = id
		path = "/network-interfaces/{iface_id}"
	}
	return method + " " + path, params
}

func (f *fakeFirecracker) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	f.mu.Lock()
	defer f.mu.Unlock()
	fail := func(code int, format string, args ...any) {
		msg := fmt.Sprintf(format, args...)
		f.errorf("fake firecracker: %s %s: %s", r.Method, r.URL.Path, msg)
		w.WriteHeader(code)
		json.NewEncoder(w).Encode(map[string]string{"fault_message": msg})
	}
	op, params := f.route(r.Method, r.URL.Path)
	sch, ok := fcSpec[op]
	if !ok {
		fail(http.StatusBadRequest, "operation not in the spec (or not one kiln should use)")
		return
	}
	f.calls = append(f.calls, op)
	if op == "GET /" {
		json.NewEncoder(w).Encode(fcInstanceInfo{ID: "fake", State: f.state, VMMVersion: "1.x", AppName: "Firecracker"})
		return
	}
	if ct := r.Header.Get("Content-Type"); ct != "application/json" {
		fail(http.StatusBadRequest, "content type %q", ct)
		return
	}
	data, _ := io.ReadAll(r.Body)
	var body map[string]any
	if err := json.Unmarshal(data, &body); err != nil {
		fail(http.StatusBadRequest, "body is not a JSON object: %v", err)
		return
	}
	f.bodies = append(f.bodies, body)
	if err := sch.check(body); err != nil {
		fail(http.StatusBadRequest, "%v", err)
		return
	}
	for _, k := range []string{"drive_id", "iface_id"} {
		if id, ok := params[k]; ok && body[k] != id {
			fail(http.StatusBadRequest, "%s %v does not match the path's %q", k, body[k], id)
			return
		}
	}
	if f.failNext == op {
		f.failNext = ""
		w.WriteHeader(http.StatusBadRequest)
		json.NewEncoder(w).Encode(map[string]string{"fault_message": "injected failure"})
		return
	}
	switch {
	case slices.Contains(preBoot, op):
		if f.state != "Not started" {
			fail(http.StatusBadRequest, "pre-boot only, VM is %s", f.state)
			return
		}
		f.touched = true
	case op == "PUT /actions" && body["action_type"] == "InstanceStart":
		if f.state != "Not started" {
			fail(http.StatusBadRequest, "already started")
			return
		}
		f.state = "Running"
	case op == "PATCH /vm":
		if f.state == "Not started" {
			fail(http.StatusBadRequest, "not started")
			return
		}
		f.state = map[string]string{"Paused": "Paused", "Resumed": "Running"}[body["state"].(string)]
	case op == "PUT /snapshot/create":
		if f.state != "Paused" {
			fail(http.StatusBadRequest, "snapshot/create needs a paused VM, it is %s", f.state)
			return
		}
	case op == "PUT /snapshot/load":
		if f.touched || f.state != "Not started" {
			fail(http.StatusBadRequest, "snapshot/load only on a fresh process")
			return
		}
		_, a := body["mem_file_path"]
		_, b := body["mem_backend"]
		if a == b {
			fail(http.StatusBadRequest, "exactly one of mem_file_path and mem_backend")
			return
		}
		f.state = "Paused"
		if body["resume_vm"] == true {
			f.state = "Running"
		}
	}
	if f.hook != nil {
		if err := f.hook(op, body); err != nil {
			fail(http.StatusBadRequest, "%v", err)
			return
		}
	}
	w.WriteHeader(http.StatusNoContent)
}

func startFake(t *testing.T) (*fakeFirecracker, *fcClient) {
	sock := filepath.Join(t.TempDir(), "fc.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	f := &fakeFirecracker{errorf: t.Errorf, state: "Not started"}
	srv := &http.Server{Handler: f}
	go srv.Serve(l)
	t.Cleanup(func() { srv.Close() })
	return f, newFCClient(sock)
}

// TestFirecrackerTemplateFlow drives the calls the driver makes to boot a
// template and snapshot it.
func TestFirecrackerTemplateFlow(t *testing.T) {
	f, c := startFake(t)
	ctx := context.Background()
	if err := c.waitReady(ctx); err != nil {
		t.Fatal(err)
	}
	steps := []func() error{
		func() error { return c.machineConfig(ctx, fcMachineConfig{VcpuCount: 1, MemSizeMiB: 512}) },
		func() error {
			return c.bootSource(ctx, fcBootSource{KernelImagePath: "/img/vmlinux", InitrdPath: "/img/initrd.img", BootArgs: "console=ttyS0 -- -guest"})
		},
		func() error {
			return c.drive(ctx, fcDrive{DriveID: "rootfs", PathOnHost: "/img/rootfs.ext4", IsRootDevice: true, IsReadOnly: true})
		},
		func() error { return c.vsock(ctx, fcVsock{GuestCID: 3, UDSPath: "/run/v.sock"}) },
		func() error { return c.entropy(ctx) },
		func() error { return c.action(ctx, "InstanceStart") },
		func() error { return c.setState(ctx, "Paused") },
		func() error {
			return c.createSnapshot(ctx, fcSnapshotCreate{SnapshotType: "Full", SnapshotPath: "/s/state", MemFilePath: "/s/mem"})
		},
	}
	for i, s := range steps {
		if err := s(); err != nil {
			t.Fatalf("step %d: %v", i, err)
		}
	}
	want := []string{"GET /", "PUT /machine-config", "PUT /boot-source", "PUT /drives/{drive_id}", "PUT /vsock",
		"PUT /entropy", "PUT /actions", "PATCH /vm", "PUT /snapshot/create"}
	if d := cmp.Diff(want, f.calls); d != "" {
		t.Errorf("calls (-want +got):\n%s", d)
	}
}

// TestFirecrackerRestoreFlow loads a snapshot into a fresh process.
func TestFirecrackerRestoreFlow(t *testing.T) {
	f, c := startFake(t)
	ctx := context.Background()
	err := c.loadSnapshot(ctx, fcSnapshotLoad{
		SnapshotPath:  "/s/state",
		MemBackend:    &fcMemBackend{BackendType: "File", BackendPath: "/s/mem"},
		ResumeVM:      true,
		VsockOverride: &fcVsockOverride{UDSPath: "/run/clone.sock"},
	})
	if err != nil {
		t.Fatal(err)
	}
	if f.state != "Running" {
		t.Errorf("state after load with resume_vm: %s", f.state)
	}
	info, err := c.describe(ctx)
	if err != nil || info.State != "Running" {
		t.Errorf("describe = %+v, %v", info, err)
	}
}

// TestFirecrackerErrors checks that API faults come back as errors with
// Firecracker's message.
func TestFirecrackerErrors(t *testing.T) {
	f, c := startFake(t)
	f.failNext = "PUT /machine-config"
	err := c.machineConfig(context.Background(), fcMachineConfig{VcpuCount: 1, MemSizeMiB: 128})
	var fe *fcError
	if !errors.As(err, &fe) || fe.Status != http.StatusBadRequest || fe.Message != "injected failure" {
		t.Errorf("err = %v", err)
	}
}

// TestFirecrackerSpecChecker makes sure the fake refuses what the spec
// refuses, so the flows above prove something.
func TestFirecrackerSpecChecker(t *testing.T) {
	for _, tc := range []struct {
		op   string
		body string
	}{
		{"PUT /machine-config", `{"vcpu_count": 1}`},
		{"PUT /machine-config", `{"vcpu_count": 64, "mem_size_mib": 128}`},
		{"PUT /machine-config", `{"vcpu_count": 1, "mem_size_mib": 128, "ht_enabled": true}`},
		{"PUT /vsock", `{"guest_cid": 2, "uds_path": "/x"}`},
		{"PUT /actions", `{"action_type": "Boot"}`},
		{"PUT /snapshot/load", `{"snapshot_path": "/s", "mem_backend": {"backend_type": "File"}}`},
		{"PATCH /vm", `{"state": "Stopped"}`},
		{"PUT /drives/{drive_id}", `{"drive_id": "r", "is_root_device": "yes"}`},
	} {
		var body map[string]any
		if err := json.Unmarshal([]byte(tc.body), &body); err != nil {
			t.Fatal(err)
		}
		if err := fcSpec[tc.op].check(body); err == nil {
			t.Errorf("%s %s passed the spec check", tc.op, tc.body)
		}
	}
}

// TestFirecrackerVsockHandshake checks the host side of Firecracker's
// vsock-over-unix-socket protocol.
func TestFirecrackerVsockHandshake(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "v.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	go func() {
		c, err := l.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		buf := make([]byte, 64)
		n, _ := c.Read(buf)
		if string(buf[:n]) != "CONNECT 1024\n" {
			c.Write([]byte("NO\n"))
			return
		}
		c.Write([]byte("OK 1073741824\nagent-bytes"))
	}()
	conn, err := fcConnectVsock(context.Background(), sock, 1024)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	rest, _ := io.ReadAll(conn)
	if string(rest) != "agent-bytes" {
		t.Errorf("stream after handshake = %q", rest)
	}
}
