//go:build !unix

package session

import "os"

func ownedByUs(string, os.FileInfo) error { return nil }
