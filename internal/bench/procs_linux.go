package bench

import (
	"os"
	"strconv"
	"sync"
	"time"
)

// procKey names one process across pid reuse.
type procKey struct {
	pid   int
	start uint64
}

type procSeen struct {
	comp        string
	first, last time.Duration
}

// procSampler counts the CPU of the control plane's processes from start
// to stop.
type procSampler struct {
	comps []component
	stopc chan struct{}
	done  chan struct{}

	mu   sync.Mutex
	seen map[procKey]*procSeen
	// skip holds the pids of processes of no component, not read again
	// (pids are not reused within a window of seconds).
	skip map[int]bool
}

func startProcSampler(comps []component) *procSampler {
	s := &procSampler{comps: comps, stopc: make(chan struct{}), done: make(chan struct{}),
		seen: map[procKey]*procSeen{}, skip: map[int]bool{}}
	s.scan(true)
	go func() {
		defer close(s.done)
		t := time.NewTicker(samplePeriod)
		defer t.Stop()
		for {
			select {
			case <-s.stopc:
				return
			case <-t.C:
				s.scan(false)
			}
		}
	}()
	return s
}

// scan reads every process's stat once. At the first scan a process's
// CPU so far is its baseline; a process first seen later was born in the
// window and all of its CPU counts.
func (s *procSampler) scan(first bool) {
	entries, err := os.ReadDir("/proc")
	if err != nil {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || s.skip[pid] {
			continue
		}
		b, err := os.ReadFile("/proc/" + e.Name() + "/stat")
		if err != nil {
			continue
		}
		comm, cpu, start, err := parseStatCPU(b)
		if err != nil {
			continue
		}
		k := procKey{pid, start}
		comp := s.component(comm)
		if p := s.seen[k]; p != nil {
			if comp != p.comp {
				// It exec'd something else (runc's init becomes the
				// box's first process): what follows is not the
				// control plane's.
				s.skip[pid] = true
				continue
			}
			p.last = cpu
			continue
		}
		if comp == "" {
			s.skip[pid] = true
			continue
		}
		p := &procSeen{comp: comp, last: cpu}
		if first {
			p.first = cpu
		}
		s.seen[k] = p
	}
}

func (s *procSampler) component(comm string) string {
	for _, c := range s.comps {
		if c.match(comm) {
			return c.name
		}
	}
	return ""
}

func (s *procSampler) stop() componentCPU {
	close(s.stopc)
	<-s.done
	s.scan(false)
	s.mu.Lock()
	defer s.mu.Unlock()
	out := componentCPU{}
	for _, c := range s.comps {
		out[c.name] = 0
	}
	for _, p := range s.seen {
		out[p.comp] += p.last - p.first
	}
	return out
}
