package kubernetes

import "kiln/internal/sandbox/sandboxtest"

// The replica and pool tests start `kiln mcp --backend kubernetes`, which
// only a kiln built with the backend's tag has.
func init() { sandboxtest.KilnTags = "kiln_kubernetes" }
