package agent

import (
	"net/netip"
	"testing"

	"github.com/mpnbd/mpnbd/pkg/mptcp"
	"github.com/mpnbd/mpnbd/pkg/nbd"
)

// TestListenersBindAbsentAddress: a storage address not on the host yet
// (its NIC comes up later) binds all the same, over MPTCP too.
func TestListenersBindAbsentAddress(t *testing.T) {
	for _, useMPTCP := range []bool{false, true} {
		if useMPTCP && mptcp.Available() != nil {
			t.Logf("MPTCP unavailable (%v): plain TCP only", mptcp.Available())
			continue
		}
		ls := NewListeners(&nbd.Server{Logger: testLogger(t)}, 0, useMPTCP, testLogger(t))
		// 192.0.2.0/24 is TEST-NET-1: on no host.
		if err := ls.Bind([]netip.Addr{netip.MustParseAddr("192.0.2.77")}); err != nil {
			t.Errorf("MPTCP %v: %v", useMPTCP, err)
		}
		ls.Close()
	}
}
