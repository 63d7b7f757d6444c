package boxpolicy

import (
	"strings"
	"testing"
)

// TestEtcFromHostHoldsNoSecrets: the host /etc entries a box sees are a
// fixed list, and none of them is a secret.
func TestEtcFromHostHoldsNoSecrets(t *testing.T) {
	for _, e := range EtcFromHost {
		for _, bad := range []string{"shadow", "gshadow", "sudoers", "ssh", "private", "passwd", "group", "."} {
			if strings.HasPrefix(e, bad) || e == "ssl" {
				t.Errorf("EtcFromHost holds %q", e)
			}
		}
	}
}
