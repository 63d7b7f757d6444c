package jail

import (
	"encoding/binary"
	"testing"
)

// The bench's allow-all program is one struct sock_filter: RET ALLOW.
func TestAllowAllProgram(t *testing.T) {
	if len(allowAll) != 8 {
		t.Fatalf("allowAll is %d bytes, want one 8-byte instruction", len(allowAll))
	}
	op := binary.NativeEndian.Uint16(allowAll[0:2])
	k := binary.NativeEndian.Uint32(allowAll[4:8])
	if op != 0x06 || allowAll[2] != 0 || allowAll[3] != 0 || k != 0x7fff0000 {
		t.Fatalf("allowAll = op %#x jt %d jf %d k %#x, want RET (0x6) ALLOW (0x7fff0000)", op, allowAll[2], allowAll[3], k)
	}
}
