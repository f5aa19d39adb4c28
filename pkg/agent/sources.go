package agent

import (
	"net/netip"
	"slices"
)

// updateKnownSourcesLocked tells the server the storage addresses of every
// node a volume is published to: their connections may take the
// handshake slots nbd.Limits.ReservedHandshakes keeps, which connections
// from anywhere else cannot exhaust. A publication that lists no
// addresses adds none (its node's connections share the other slots).
// a.mu must be held.
func (a *Agent) updateKnownSourcesLocked() {
	var addrs []netip.Addr
	for _, v := range a.vols {
		for _, g := range v.grants {
			addrs = append(addrs, g.addrs...)
		}
	}
	slices.SortFunc(addrs, netip.Addr.Compare)
	a.srv.SetKnownSources(slices.Compact(addrs))
}
