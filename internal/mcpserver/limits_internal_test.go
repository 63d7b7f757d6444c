package mcpserver

import (
	"encoding/base64"
	"encoding/json"
	"strings"
	"testing"
)

// TestFilesLimitReachable: the per-call files limit must be below what one
// message can carry, so a client that sends too much gets the files error
// and not a transport error, in text and in base64 alike.
func TestFilesLimitReachable(t *testing.T) {
	for _, enc := range []string{"text", "base64"} {
		t.Run(enc, func(t *testing.T) {
			// The largest payload of this encoding that still fits in one
			// message, with room for the rest of the tools/call.
			n := maxMessageBytes - 4096
			if enc == "base64" {
				n = n / 4 * 3
			}
			content := strings.Repeat("a", n)
			if enc == "base64" {
				content = "base64:" + base64.StdEncoding.EncodeToString([]byte(content))
			}
			files := map[string]string{"big.txt": content}
			msg, err := json.Marshal(map[string]any{"jsonrpc": "2.0", "id": 1, "method": "tools/call",
				"params": map[string]any{"name": "run_python", "arguments": map[string]any{"code": "1", "files": files}}})
			if err != nil {
				t.Fatal(err)
			}
			if len(msg) > maxMessageBytes {
				t.Fatalf("test payload of %d bytes does not fit in a message of %d", len(msg), maxMessageBytes)
			}
			if _, err := decodeFiles(files); err == nil {
				t.Errorf("%d bytes of files (%s) fit in one %d-byte message and are accepted: the files limit can never be reached", n, enc, maxMessageBytes)
			}
		})
	}
}
