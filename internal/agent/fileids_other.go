//go:build !linux

package agent

import "errors"

var errNoFileIDs = errors.New("acting as another user on files is not supported on this OS")

func asUser(uid, gid int, f func() error) error { return errNoFileIDs }
