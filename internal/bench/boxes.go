package bench

import (
	"fmt"
	"regexp"
	"slices"
	"strings"
	"sync"
	"time"
)

// How each box was made, read from its server's debug log: the jail logs
// "forked a box" with path=one-step or path=two-step (a fork of its
// template, in one clone or through a helper process) and "started a
// box" with path=direct (a box of its own python). Other backends log
// neither, and their rows say nothing of it.

// A kiln from before path= logged one_step=true or false alone.
var (
	boxPathRe    = regexp.MustCompile(`msg="(?:forked|started) a box".* path=([a-z-]+)`)
	boxOneStepRe = regexp.MustCompile(`msg="forked a box".* one_step=(true|false)`)
	// The line the server logs at the end of every tool call, with the
	// time it spent on it, from its request to its answer.
	callDurationRe = regexp.MustCompile(`msg=call .*\bduration=([0-9.]+[µnm]?s)\b`)
)

// boxCounts counts one server's boxes by path, and adds each to total,
// the run's.
type boxCounts struct {
	mu    sync.Mutex
	n     map[string]int
	total *boxCounts
	calls []time.Duration // what the server logged each call took, in order
}

func (c *boxCounts) add(path string) {
	if c == nil {
		return
	}
	c.mu.Lock()
	if c.n == nil {
		c.n = map[string]int{}
	}
	c.n[path]++
	c.mu.Unlock()
	c.total.add(path)
}

// line counts the box a server's log line reports, if it reports one.
func (c *boxCounts) line(s string) {
	if m := callDurationRe.FindStringSubmatch(s); m != nil {
		if d, err := time.ParseDuration(m[1]); err == nil {
			c.mu.Lock()
			c.calls = append(c.calls, d)
			c.mu.Unlock()
		}
		return
	}
	if m := boxPathRe.FindStringSubmatch(s); m != nil {
		c.add(m[1])
	} else if m := boxOneStepRe.FindStringSubmatch(s); m != nil {
		c.add(map[string]string{"true": "one-step", "false": "two-step"}[m[1]])
	}
}

func (c *boxCounts) snapshot() map[string]int {
	if c == nil {
		return nil
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	out := make(map[string]int, len(c.n))
	for k, v := range c.n {
		out[k] = v
	}
	return out
}

// since is what was counted after snapshot then.
func (c *boxCounts) since(then map[string]int) map[string]int {
	now := c.snapshot()
	for k, v := range then {
		now[k] -= v
		if now[k] == 0 {
			delete(now, k)
		}
	}
	return now
}

// callsSince returns the call durations the server logged after the
// first n.
func (c *boxCounts) callsSince(n int) []time.Duration {
	c.mu.Lock()
	defer c.mu.Unlock()
	return slices.Clone(c.calls[min(n, len(c.calls)):])
}

func (c *boxCounts) callsLogged() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.calls)
}

// boxesMade notes on the row keyed key how the boxes made during it were
// made.
func (r *runner) boxesMade(key string, made map[string]int) {
	m := r.rep.get(key)
	if m == nil || len(made) == 0 {
		return
	}
	m.Boxes = made
	m.Note += "; boxes made: " + describeBoxes(made)
}

// describeBoxes says "51 one-step, 2 direct", the most common first.
func describeBoxes(made map[string]int) string {
	keys := make([]string, 0, len(made))
	for k := range made {
		keys = append(keys, k)
	}
	slices.SortFunc(keys, func(a, b string) int {
		if made[a] != made[b] {
			return made[b] - made[a]
		}
		return strings.Compare(a, b)
	})
	parts := make([]string, len(keys))
	for i, k := range keys {
		parts[i] = fmt.Sprintf("%d %s", made[k], k)
	}
	return strings.Join(parts, ", ")
}
