package agentproto

// State operations: a state-level snapshot of a box (the workspace's files
// and the Python kernel's globals), packed into one archive inside the box
// by the kernel itself. The host moves the archive's bytes and never
// decodes them: it pulls a saved archive in chunks (OpReadState) and
// pushes one into a fresh box (OpWriteState) before loading it.
const (
	// OpSaveState packs the box's state into an archive inside the box
	// and answers with its size (Size) and what was saved (State).
	OpSaveState = "save_state"
	// OpReadState reads the saved archive from Offset, at most MaxBytes
	// (and MaxRead); it answers like OpRead.
	OpReadState = "read_state"
	// OpWriteState appends Data to the archive being pushed into the
	// box; Offset is where it starts and must equal what was written so
	// far (0 starts a new archive).
	OpWriteState = "write_state"
	// OpLoadState unpacks the pushed archive: its files into the
	// workspace, its globals into the kernel. State says what was loaded.
	OpLoadState = "load_state"
)

// Bounds on a State answer; the driver keeps to them.
const (
	// MaxStateNames is the most entries in each of State's lists.
	MaxStateNames = 2048
	// MaxStateEntry is the longest entry, in bytes.
	MaxStateEntry = 512
)

// StateInfo is what a save or a load did: the kernel globals it saved (or
// loaded), and what it could not, one entry each with the reason
// ("gen: cannot pickle 'generator' object").
type StateInfo struct {
	Saved   []string `json:"saved,omitempty"`
	Dropped []string `json:"dropped,omitempty"`
}

func (s *StateInfo) check() error {
	for _, l := range [][]string{s.Saved, s.Dropped} {
		if len(l) > MaxStateNames {
			return faultf("state answer: %d entries, at most %d", len(l), MaxStateNames)
		}
		for i, e := range l {
			if len(e) > MaxStateEntry {
				return faultf("state answer: entry %d of %d bytes, at most %d", i, len(e), MaxStateEntry)
			}
		}
	}
	return nil
}
