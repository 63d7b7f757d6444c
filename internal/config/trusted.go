package config

import (
	"errors"
	"fmt"
	"os"
)

// ErrUnsafeFile is returned for a file kiln trusts that others can
// change, or, for a secret, read.
var ErrUnsafeFile = errors.New("unsafe file")

// OpenTrusted opens a file kiln trusts: the configuration, the token
// file, the issuer's key set, the egress hosts file. Whoever can change
// such a file holds the server (it names the binaries kiln runs, who may
// call it, which keys sign accepted tokens, where allowed names go), so
// it must be a regular file owned by root or by the user running kiln
// and writable by no one else; a secret must be readable by no one else
// either. What is checked is the file opened (its descriptor, not its
// path), so the file read is the file checked. what names the file in
// errors ("token file").
//
// Every such file is opened here, once, so that none is trusted with
// fewer checks than another.
func OpenTrusted(what, path string, secret bool) (*os.File, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("reading the %s: %w", what, err)
	}
	fi, err := f.Stat()
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("reading the %s: %w", what, err)
	}
	if !fi.Mode().IsRegular() {
		f.Close()
		return nil, fmt.Errorf("the %s %s is not a regular file (%v)", what, path, fi.Mode().Type())
	}
	if err := checkTrusted(what, path, fi, secret); err != nil {
		f.Close()
		return nil, err
	}
	return f, nil
}
