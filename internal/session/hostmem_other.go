//go:build !linux

package session

func hostMemory() int64 { return 0 }
