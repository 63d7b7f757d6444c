// Package docs holds no code: its test checks that every relative link and
// #anchor in README.md, CONTRIBUTING.md and docs/**/*.md resolves, the
// files existing and the anchors matching GitHub's heading slugs. It is a
// package of its own because the documents belong to no other package, and
// go test ./... then runs the check with every other test.
package docs
