package bench

// boxFinder lists the processes of each box of the kiln server with the
// given pid, keyed by box. It is the one part of the bench a backend may
// need to supply.
type boxFinder func(serverPid int) (map[string][]int, error)

// memInfo is what /proc/PID/smaps_rollup says of a process, in KiB.
type memInfo struct {
	Rss, Pss, Private int64
}
