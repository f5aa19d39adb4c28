// Copyright 2026 The mpnbd Authors.
//
// Licensed under the Apache License, Version 2.0 (the "License");
// you may not use this file except in compliance with the License.
// You may obtain a copy of the License at
//
//     http://www.apache.org/licenses/LICENSE-2.0
//
// Unless required by applicable law or agreed to in writing, software
// distributed under the License is distributed on an "AS IS" BASIS,
// WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
// See the License for the specific language governing permissions and
// limitations under the License.

package nbd

import (
	"errors"
	"net"
	"net/netip"
	"slices"
	"sync"
	"time"
)

// Limits bounds what clients can make a Server hold, so that one client,
// or a flood of connections that never finish the handshake, cannot
// exhaust the process. A zero field takes the default below; a negative
// one turns that limit off.
//
// A connection counts towards MaxConns and MaxConnsPerSource from the
// moment it is accepted until it is closed, and towards MaxHandshakes and
// MaxHandshakesPerSource until it finished option haggling. Connections
// over these limits are closed at once, before anything is read from them
// or any buffer is allocated for them. MaxConnsPerExport is checked when a
// client chooses an export (NBD_OPT_GO or NBD_OPT_EXPORT_NAME): GO is
// answered with NBD_REP_ERR_POLICY, EXPORT_NAME (which has no error reply)
// with a hang-up. Per-source limits apply to IP sources only; connections
// over other transports (UNIX sockets, pipes) count only in the totals.
type Limits struct {
	// MaxConnsPerExport bounds the connections to one export that chose it
	// and are not closed yet. Default DefaultMaxConnsPerExport.
	MaxConnsPerExport int
	// MaxConnsPerSource bounds the connections from one source IP address.
	// Default DefaultMaxConnsPerSource.
	MaxConnsPerSource int
	// MaxConns bounds all connections. Default DefaultMaxConns.
	MaxConns int
	// MaxHandshakesPerSource bounds the connections from one source IP
	// address that have not finished the handshake. Default
	// DefaultMaxHandshakesPerSource.
	MaxHandshakesPerSource int
	// MaxHandshakes bounds all connections that have not finished the
	// handshake. Default DefaultMaxHandshakes.
	MaxHandshakes int
	// ReservedHandshakes are handshake slots of MaxHandshakes that only
	// connections from known sources may take (Server.SetKnownSources: for
	// a storage agent, the storage addresses of the nodes its volumes are
	// published to); connections from any other address share the rest.
	// A few addresses that flood the port with handshakes they never
	// finish then cannot refuse the nodes' redials: they fill the shared
	// slots only, and MaxHandshakesPerSource keeps one known address from
	// taking the reserve alone. It applies once SetKnownSources was
	// called, even with no address; before that every slot is shared.
	// Default: half of MaxHandshakes (DefaultReservedHandshakes with its
	// default); more than MaxHandshakes leaves unknown sources none.
	ReservedHandshakes int
	// HandshakeTimeout is how long a connection may take from being
	// accepted to choosing an export; it is closed then. Default
	// DefaultHandshakeTimeout.
	HandshakeTimeout time.Duration
}

// Defaults of Limits. A storage node's clients are the CSI nodes: each
// attached volume holds a few connections (one per NBD queue, plus
// superseded ones not yet noticed as dead), and one node can attach many
// volumes. The connection limits leave room for that many times over; the
// handshake limits are smaller, as a legitimate client finishes its
// handshake in a few round trips, but still let every volume of a busy
// node redial at once after a storage server restart (a refused redial
// only waits for its backoff, which lengthens the outage).
const (
	DefaultMaxConnsPerExport      = 64
	DefaultMaxConnsPerSource      = 512
	DefaultMaxConns               = 4096
	DefaultMaxHandshakesPerSource = 128
	DefaultMaxHandshakes          = 1024
	DefaultReservedHandshakes     = DefaultMaxHandshakes / 2
	DefaultHandshakeTimeout       = 10 * time.Second
)

// Reasons given to LimitObserver.ConnRefused.
const (
	RefusedTotal               = "total"
	RefusedPerSource           = "per_source"
	RefusedHandshakesTotal     = "handshakes_total"
	RefusedHandshakesPerSource = "handshakes_per_source"
	RefusedHandshakesUnknown   = "handshakes_unknown_sources"
	RefusedHandshakeTimeout    = "handshake_timeout"
	RefusedPerExport           = "per_export"
)

// RefusalReasons lists every reason a connection can be refused for.
var RefusalReasons = []string{
	RefusedTotal, RefusedPerSource, RefusedHandshakesTotal,
	RefusedHandshakesPerSource, RefusedHandshakesUnknown, RefusedHandshakeTimeout, RefusedPerExport,
}

// LimitObserver may be implemented by a Server's Observer to learn of
// connections closed by the Limits and of the counts they bound. Calls
// must not block.
type LimitObserver interface {
	// ConnRefused is called for each connection closed by a limit.
	ConnRefused(c ConnInfo, reason string)
	// ConnCounts is called with the numbers of open connections and of
	// those still in the handshake after each change.
	ConnCounts(conns, handshakes int)
}

// errPerExport ends a negotiation refused by MaxConnsPerExport.
var errPerExport = errors.New("nbd: too many connections to the export")

// resolvedLimits are Limits with defaults applied; 0 means no limit.
type resolvedLimits struct {
	perExport, perSource, total, hsPerSource, hsTotal int
	// hsReserved is how many of hsTotal are kept for known sources; 0
	// with hsTotal 0.
	hsReserved int
	hsTimeout  time.Duration
}

func pickLimit(v, def int) int {
	switch {
	case v == 0:
		return def
	case v < 0:
		return 0
	}
	return v
}

func (l Limits) resolve() resolvedLimits {
	r := resolvedLimits{
		perExport:   pickLimit(l.MaxConnsPerExport, DefaultMaxConnsPerExport),
		perSource:   pickLimit(l.MaxConnsPerSource, DefaultMaxConnsPerSource),
		total:       pickLimit(l.MaxConns, DefaultMaxConns),
		hsPerSource: pickLimit(l.MaxHandshakesPerSource, DefaultMaxHandshakesPerSource),
		hsTotal:     pickLimit(l.MaxHandshakes, DefaultMaxHandshakes),
		hsTimeout:   l.HandshakeTimeout,
	}
	switch {
	case r.hsTotal == 0 || l.ReservedHandshakes < 0:
	case l.ReservedHandshakes == 0:
		r.hsReserved = r.hsTotal / 2
	default:
		r.hsReserved = min(l.ReservedHandshakes, r.hsTotal)
	}
	switch {
	case r.hsTimeout == 0:
		r.hsTimeout = DefaultHandshakeTimeout
	case r.hsTimeout < 0:
		r.hsTimeout = 0
	}
	return r
}

// over reports whether n more than the limit max (0: none).
func over(n, max int) bool { return max > 0 && n >= max }

// sourceCount is what one source IP address holds.
type sourceCount struct {
	conns, handshakes int
}

// connCounts tracks the connections a Server holds, for its Limits.
type connCounts struct {
	mu         sync.Mutex
	conns      int
	handshakes int
	// unknownHandshakes are the handshakes from sources not known, which
	// ReservedHandshakes does not let grow past the shared slots.
	unknownHandshakes int
	sources           map[netip.Addr]*sourceCount
	// known are the sources ReservedHandshakes are kept for; knownSet
	// says SetKnownSources was called (the reserve applies).
	known    map[netip.Addr]struct{}
	knownSet bool
}

// admission is one admitted connection's share of the counts.
type admission struct {
	src         netip.Addr // invalid when not an IP source
	unknown     bool       // counted in unknownHandshakes while handshaking
	handshaking bool
	released    bool
}

// SetKnownSources replaces the source addresses that may take the
// handshake slots Limits.ReservedHandshakes keeps (IPv4-mapped addresses
// count as IPv4). Connections already admitted keep their class. The
// reserve applies from the first call on, also when addrs is empty.
func (s *Server) SetKnownSources(addrs []netip.Addr) {
	known := make(map[netip.Addr]struct{}, len(addrs))
	for _, a := range addrs {
		known[a.Unmap()] = struct{}{}
	}
	cc := &s.counts
	cc.mu.Lock()
	cc.known, cc.knownSet = known, true
	cc.mu.Unlock()
}

// sourceAddr is the IP address a connection comes from, if any.
func sourceAddr(a net.Addr) (netip.Addr, bool) {
	var ap netip.AddrPort
	switch a := a.(type) {
	case *net.TCPAddr:
		ap = a.AddrPort()
	case *net.UDPAddr:
		ap = a.AddrPort()
	default:
		if a == nil {
			return netip.Addr{}, false
		}
		p, err := netip.ParseAddrPort(a.String())
		if err != nil {
			return netip.Addr{}, false
		}
		ap = p
	}
	ip := ap.Addr().Unmap()
	return ip, ip.IsValid()
}

// KnownSources returns the addresses SetKnownSources set last, sorted
// (nil before the first call).
func (s *Server) KnownSources() []netip.Addr {
	cc := &s.counts
	cc.mu.Lock()
	defer cc.mu.Unlock()
	if !cc.knownSet {
		return nil
	}
	out := make([]netip.Addr, 0, len(cc.known))
	for a := range cc.known {
		out = append(out, a)
	}
	slices.SortFunc(out, netip.Addr.Compare)
	return out
}

// ConnStats are the counts a Server's Limits bound.
type ConnStats struct {
	// Conns are the open connections, in the handshake or past it.
	Conns int
	// Handshakes are the connections that have not chosen an export yet.
	Handshakes int
	// Sources are the source IP addresses with an open connection.
	Sources int
	// UnknownHandshakes are the Handshakes from sources that are not
	// known (SetKnownSources) while the reserve applies.
	UnknownHandshakes int
}

// ConnStats returns the current counts.
func (s *Server) ConnStats() ConnStats {
	s.counts.mu.Lock()
	defer s.counts.mu.Unlock()
	return ConnStats{Conns: s.counts.conns, Handshakes: s.counts.handshakes, Sources: len(s.counts.sources),
		UnknownHandshakes: s.counts.unknownHandshakes}
}

// admit counts a new connection in, or returns the reason to refuse it.
func (s *Server) admit(remote net.Addr) (*admission, string) {
	lim := s.Limits.resolve()
	src, isIP := sourceAddr(remote)
	cc := &s.counts
	cc.mu.Lock()
	defer cc.mu.Unlock()
	var sc *sourceCount
	if isIP {
		sc = cc.sources[src]
	}
	if sc == nil {
		sc = &sourceCount{}
	}
	// A connection from an unknown source may take a shared slot only
	// (the reserve applies once the known sources were set).
	unknown := false
	if cc.knownSet && lim.hsReserved > 0 {
		_, known := cc.known[src]
		unknown = !isIP || !known
	}
	switch {
	case over(cc.conns, lim.total):
		return nil, RefusedTotal
	case isIP && over(sc.conns, lim.perSource):
		return nil, RefusedPerSource
	case over(cc.handshakes, lim.hsTotal):
		return nil, RefusedHandshakesTotal
	case isIP && over(sc.handshakes, lim.hsPerSource):
		return nil, RefusedHandshakesPerSource
	case unknown && cc.unknownHandshakes >= lim.hsTotal-lim.hsReserved:
		return nil, RefusedHandshakesUnknown
	}
	cc.conns++
	cc.handshakes++
	a := &admission{handshaking: true, unknown: unknown}
	if unknown {
		cc.unknownHandshakes++
	}
	if isIP {
		if cc.sources == nil {
			cc.sources = make(map[netip.Addr]*sourceCount)
		}
		sc.conns++
		sc.handshakes++
		cc.sources[src] = sc
		a.src = src
	}
	s.reportCounts()
	return a, ""
}

// handshakeDone takes a out of the handshake counts.
func (s *Server) handshakeDone(a *admission) {
	cc := &s.counts
	cc.mu.Lock()
	defer cc.mu.Unlock()
	if a.released || !a.handshaking {
		return
	}
	a.handshaking = false
	cc.handshakes--
	if a.unknown {
		cc.unknownHandshakes--
	}
	if sc := cc.sources[a.src]; sc != nil {
		sc.handshakes--
	}
	s.reportCounts()
}

// release takes a out of every count.
func (s *Server) release(a *admission) {
	cc := &s.counts
	cc.mu.Lock()
	defer cc.mu.Unlock()
	if a.released {
		return
	}
	a.released = true
	cc.conns--
	if a.handshaking {
		cc.handshakes--
		if a.unknown {
			cc.unknownHandshakes--
		}
	}
	if sc := cc.sources[a.src]; sc != nil {
		sc.conns--
		if a.handshaking {
			sc.handshakes--
		}
		if sc.conns == 0 {
			delete(cc.sources, a.src)
		}
	}
	s.reportCounts()
}

// reportCounts tells the observer the counts; cc.mu is held, so that the
// observer sees them in order.
func (s *Server) reportCounts() {
	if lo, ok := s.Observer.(LimitObserver); ok {
		lo.ConnCounts(s.counts.conns, s.counts.handshakes)
	}
}

// refused reports a connection closed by a limit.
func (s *Server) refused(c ConnInfo, reason string) {
	s.log().Debug("connection refused by limit", "remote", addrString(c.RemoteAddr), "reason", reason)
	if lo, ok := s.Observer.(LimitObserver); ok {
		lo.ConnRefused(c, reason)
	}
}

func addrString(a net.Addr) string {
	if a == nil {
		return ""
	}
	return a.String()
}

// reserve takes one of the export's connection slots.
func (e *Export) reserve(max int) bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	if over(e.reserved, max) {
		return false
	}
	e.reserved++
	return true
}

func (e *Export) unreserve() {
	e.mu.Lock()
	e.reserved--
	e.mu.Unlock()
}

// Reserved is the number of connections that chose the export and are not
// closed yet (what MaxConnsPerExport bounds).
func (e *Export) Reserved() int {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.reserved
}
