// Command mkimage pushes a one-layer image made of static files to a
// registry on loopback (plain HTTP): the test cluster's pause image and
// the smoke test's probe image.
//
//	mkimage -ref localhost:5000/kiln/pause:3.10 -entrypoint /pause -user 65535:65535 pause=/path/to/pause
package main

import (
	"flag"
	"fmt"
	"os"

	"kiln/contrib/k8s/cluster/tools/ociimage"
)

func main() {
	ref := flag.String("ref", "", "image reference to push to")
	entry := flag.String("entrypoint", "", "the image's entrypoint (one path)")
	user := flag.String("user", "", "the image's user (uid:gid)")
	flag.Parse()
	if *ref == "" || *entry == "" || flag.NArg() == 0 {
		fmt.Fprintln(os.Stderr, "usage: mkimage -ref REF -entrypoint PATH [-user UID:GID] name=file...")
		os.Exit(2)
	}
	digest, err := ociimage.Push(*ref, *entry, *user, flag.Args())
	if err != nil {
		fmt.Fprintln(os.Stderr, "mkimage:", err)
		os.Exit(1)
	}
	fmt.Println(digest)
}
