//go:build !linux

package bench

type procSampler struct{}

func startProcSampler([]component) *procSampler { return nil }

func (*procSampler) stop() componentCPU { return nil }
