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
	"net"
	"net/netip"
	"sync"
)

// Memory held by requests in flight is bounded three ways: per connection
// (MaxInflightBytes), per export and per source address (the budgets
// below). The per-connection bound alone let one client hold it many
// times over: a published node may open up to MaxConnsPerExport
// connections to each of its volumes, each allowed 64 MiB. A request
// waits, unread beyond its header, until each of its budgets has room; it
// holds nothing else meanwhile, and the requests that hold the budgets
// finish without waiting for it, so the wait always ends (unless a client
// stops reading its replies: then it stalls its own connections, the
// export it uses and its own source, no one else's).
//
// A request is charged what it really holds: its bookkeeping (reqOverhead)
// and, for a read or a write, its pooled buffer, whose capacity is the
// length rounded up to a power of two.

// Defaults of the shared budgets.
const (
	DefaultMaxInflightBytesPerExport = 256 << 20
	DefaultMaxInflightBytesPerSource = 512 << 20
)

// reqOverhead is what a request holds besides its data: its work item,
// its queued reply and its share of the reply batch, rounded up.
const reqOverhead = 256

// requestCharge is what req holds while it is in flight.
func requestCharge(req Request) int {
	if (req.Type == CmdRead || req.Type == CmdWrite) && req.Length > 0 {
		n := int(req.Length)
		if n <= 1<<maxPoolShift {
			n = 1 << (poolIndex(n) + minPoolShift)
		}
		return reqOverhead + n
	}
	return reqOverhead
}

// budget is memory shared by the requests of several connections.
type budget struct {
	mu   sync.Mutex
	cond sync.Cond
	used int
	max  int
	refs int // connections that charge it (source budgets)
}

func newBudget(max int) *budget {
	b := &budget{max: max}
	b.cond.L = &b.mu
	return b
}

// acquire charges n bytes, waiting for room; a charge larger than the
// budget is admitted when nothing else is charged.
func (b *budget) acquire(n int) {
	n = min(n, b.max)
	b.mu.Lock()
	for b.used > 0 && b.used+n > b.max {
		b.cond.Wait()
	}
	b.used += n
	b.mu.Unlock()
}

func (b *budget) release(n int) {
	n = min(n, b.max)
	b.mu.Lock()
	b.used -= n
	b.mu.Unlock()
	b.cond.Broadcast()
}

// held returns the bytes charged.
func (b *budget) held() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.used
}

// exportBudget returns e's budget, made on first use; nil when off.
func (s *Server) exportBudget(e *Export) *budget {
	max := pickLimit(s.MaxInflightBytesPerExport, DefaultMaxInflightBytesPerExport)
	if max == 0 {
		return nil
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.mem == nil {
		e.mem = newBudget(max)
	}
	return e.mem
}

// sourceOf is the IP address a connection comes from, if it has one.
func sourceOf(a net.Addr) (netip.Addr, bool) {
	ta, ok := a.(*net.TCPAddr)
	if !ok {
		return netip.Addr{}, false
	}
	ip, ok := netip.AddrFromSlice(ta.IP)
	return ip.Unmap(), ok
}

// sourceBudget returns the budget of a connection's source address and a
// function that gives it back; nil for none.
func (s *Server) sourceBudget(a net.Addr) (*budget, func()) {
	max := pickLimit(s.MaxInflightBytesPerSource, DefaultMaxInflightBytesPerSource)
	ip, ok := sourceOf(a)
	if max == 0 || !ok {
		return nil, func() {}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.srcMem == nil {
		s.srcMem = make(map[netip.Addr]*budget)
	}
	b := s.srcMem[ip]
	if b == nil {
		b = newBudget(max)
		s.srcMem[ip] = b
	}
	b.refs++
	return b, func() {
		s.mu.Lock()
		defer s.mu.Unlock()
		if b.refs--; b.refs == 0 {
			delete(s.srcMem, ip)
		}
	}
}
