package agent

import (
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"syscall"

	"kiln/internal/agentproto"
)

// State-level snapshots, inside the box. The kernel (driver.py) packs the
// workspace and its globals into one tar in the box's temporary directory
// and unpacks one there; the agent only moves the archive's bytes to and
// from the host. The archive is the code's own file: it is made and read
// with the code's rights, so nothing in it reaches further than code can.

// stateAnswer is the driver's answer to a state request.
type stateAnswer struct {
	Cell  string                `json:"cell"`
	State *agentproto.StateInfo `json:"state"`
	Error string                `json:"state_error"`
}

// statePath is a fresh name for an archive in the box's temporary
// directory, which code shares with the kernel.
func statePath(kind string) string {
	return filepath.Join(os.TempDir(), ".kiln-"+kind+"-"+hex.EncodeToString(randomBytes(8))+".tar")
}

// saveState asks the kernel to pack the box's state into a new archive and
// returns its size. The previous saved archive, if any, is removed.
func (a *Agent) saveState() (*agentproto.StateInfo, int64, error) {
	a.kmu.Lock()
	defer a.kmu.Unlock()
	a.dropSaved()
	path := statePath("save")
	info, err := a.kernelState("save", path)
	if err != nil {
		a.asCode(func() error { return os.Remove(path) })
		return nil, 0, err
	}
	var size int64
	err = a.asCode(func() error {
		st, err := os.Lstat(path)
		if err == nil {
			if !st.Mode().IsRegular() {
				return errors.New("the saved state is not a regular file")
			}
			size = st.Size()
		}
		return err
	})
	if err != nil {
		return nil, 0, fmt.Errorf("saving state: %w", err)
	}
	a.savePath = path
	return info, size, nil
}

func (a *Agent) dropSaved() {
	if a.savePath != "" {
		p := a.savePath
		a.asCode(func() error { return os.Remove(p) })
		a.savePath = ""
	}
}

// readState reads the saved archive from off, at most max bytes (and
// agentproto.MaxRead). Reading its last byte removes it.
func (a *Agent) readState(off, max int64) (data []byte, size int64, err error) {
	a.kmu.Lock()
	defer a.kmu.Unlock()
	if a.savePath == "" {
		return nil, 0, errors.New("no saved state to read: save it first")
	}
	if max <= 0 || max > agentproto.MaxRead {
		max = agentproto.MaxRead
	}
	err = a.asCode(func() error {
		f, err := os.OpenFile(a.savePath, os.O_RDONLY|syscall.O_NOFOLLOW, 0)
		if err != nil {
			return err
		}
		defer f.Close()
		st, err := f.Stat()
		if err != nil {
			return err
		}
		size = st.Size()
		if off < 0 || off > size {
			return fmt.Errorf("offset %d is outside the saved state of %d bytes", off, size)
		}
		data = make([]byte, min(max, size-off))
		_, err = io.ReadFull(io.NewSectionReader(f, off, int64(len(data))), data)
		return err
	})
	if err != nil {
		return nil, 0, fmt.Errorf("reading saved state: %w", err)
	}
	if off+int64(len(data)) >= size {
		a.dropSaved()
	}
	return data, size, nil
}

// writeState appends a chunk to the archive being pushed; offset 0 starts
// a new one.
func (a *Agent) writeState(off int64, data []byte) error {
	a.kmu.Lock()
	defer a.kmu.Unlock()
	if off == 0 {
		a.dropLoad()
		a.loadPath = statePath("load")
		a.loadSize = 0
	}
	if a.loadPath == "" || off != a.loadSize {
		return fmt.Errorf("state chunk at offset %d, expected %d", off, a.loadSize)
	}
	flags := os.O_WRONLY | os.O_APPEND | syscall.O_NOFOLLOW
	if off == 0 {
		flags |= os.O_CREATE | os.O_EXCL
	}
	err := a.asCode(func() error {
		f, err := os.OpenFile(a.loadPath, flags, 0o600)
		if err != nil {
			return err
		}
		if off == 0 && os.Getuid() == 0 && a.cfg.UID > 0 {
			f.Chown(a.cfg.UID, a.cfg.GID) // where asCode could not act as the code's user
		}
		_, err = f.Write(data)
		return errors.Join(err, f.Close())
	})
	if err != nil {
		a.dropLoad()
		return fmt.Errorf("writing state: %w", err)
	}
	a.loadSize += int64(len(data))
	return nil
}

func (a *Agent) dropLoad() {
	if a.loadPath != "" {
		p := a.loadPath
		a.asCode(func() error { return os.Remove(p) })
		a.loadPath, a.loadSize = "", 0
	}
}

// loadState asks the kernel to unpack the pushed archive.
func (a *Agent) loadState() (*agentproto.StateInfo, error) {
	a.kmu.Lock()
	defer a.kmu.Unlock()
	if a.loadPath == "" {
		return nil, errors.New("no state to load: push it first")
	}
	defer a.dropLoad()
	return a.kernelState("load", a.loadPath)
}

// kernelState sends a state request to the kernel (starting one if
// needed) and waits for its answer. The caller holds kmu.
func (a *Agent) kernelState(op, path string) (*agentproto.StateInfo, error) {
	if a.cfg.Python == "" {
		return nil, errors.New("python is not available in this sandbox")
	}
	k := a.currentKernel()
	if k == nil {
		var err error
		if k, err = startKernel(a.cfg); err != nil {
			return nil, err
		}
		a.setKernel(k)
	}
	ans, err := k.stateOp(op, path, a.cfg.Workspace)
	if err != nil {
		k.kill()
		a.setKernel(nil)
		return nil, fmt.Errorf("the python kernel died while it was asked to %s its state; its variables are gone", op)
	}
	if ans.Error != "" {
		return nil, errors.New(ans.Error)
	}
	if ans.State == nil {
		return nil, errors.New("the kernel did not say what it saved")
	}
	return ans.State, nil
}

// stateOp sends one state request and reads its answer, skipping lines that
// answer something else (a cell may write to fd 4 itself).
func (k *pyKernel) stateOp(op, path, workspace string) (*stateAnswer, error) {
	cell := hex.EncodeToString(randomBytes(16))
	req, _ := json.Marshal(map[string]any{"cell": cell, "state": map[string]string{"op": op, "path": path, "workspace": workspace}})
	if _, err := k.req.Write(append(req, '\n')); err != nil {
		return nil, errKernelDied
	}
	for {
		line, err := k.readLine()
		if err != nil {
			return nil, errKernelDied
		}
		var ans stateAnswer
		if json.Unmarshal(line, &ans) == nil && ans.Cell == cell {
			return &ans, nil
		}
	}
}
