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

package agent

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"slices"
	"strconv"
	"sync"

	"github.com/mpnbd/mpnbd/pkg/nbd"
)

// Listeners binds the NBD port on the storage node's storage addresses
// only, never on every address: clients from the other networks of the
// host (management, public) cannot reach the port at all, let alone
// take its handshake slots.
//
// The addresses are of two kinds. Fixed ones (Bind: the --storage-address
// list, the addresses clients dial) are bound once, with IP_FREEBIND
// where the kernel has it, so that one whose NIC comes up late is served
// as soon as it does. Followed ones (Follow: the addresses of the NICs
// that carry MPTCP signal endpoints, which clients join subflows to) come
// and go with the NICs' addresses: each run of the endpoint watch opens
// the port on a new address before its endpoint is announced, and closes
// it on an address that left.
//
// Every listener is served by one nbd.Server, from Serve on.
type Listeners struct {
	srv   *nbd.Server
	mptcp bool
	log   *slog.Logger

	mu      sync.Mutex
	port    int
	fixed   map[netip.Addr]net.Listener
	follow  map[netip.Addr]net.Listener
	serving bool
	closed  bool
	wg      sync.WaitGroup
}

// NewListeners returns listeners for srv on port (0: the first Bind picks
// one, which every later listener shares), asking for MPTCP unless
// useMPTCP is false.
func NewListeners(srv *nbd.Server, port int, useMPTCP bool, log *slog.Logger) *Listeners {
	if log == nil {
		log = slog.Default()
	}
	return &Listeners{
		srv: srv, mptcp: useMPTCP, log: log, port: port,
		fixed: map[netip.Addr]net.Listener{}, follow: map[netip.Addr]net.Listener{},
	}
}

// Bind binds the port on each of addrs for good. It fails, closing
// nothing it bound before, when one cannot be bound: a fixed address is
// where clients are told to dial.
func (l *Listeners) Bind(addrs []netip.Addr) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, a := range addrs {
		a = a.Unmap()
		if _, ok := l.fixed[a]; ok {
			continue
		}
		ln, err := l.listenLocked(a, true)
		if err != nil {
			return err
		}
		l.fixed[a] = ln
	}
	return nil
}

// Follow makes the followed addresses addrs: the port is opened on those
// not bound yet and closed on those no longer in addrs (connections
// accepted there stay). An address that cannot be bound is logged and
// tried again at the next call. Fixed addresses are left alone.
func (l *Listeners) Follow(addrs []netip.Addr) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		return
	}
	want := map[netip.Addr]bool{}
	for _, a := range addrs {
		want[a.Unmap()] = true
	}
	for a, ln := range l.follow {
		if !want[a] {
			ln.Close()
			delete(l.follow, a)
			l.log.Info("NBD port closed on an address that left its storage NIC", "addr", a.String())
		}
	}
	for a := range want {
		if _, ok := l.fixed[a]; ok {
			continue
		}
		if _, ok := l.follow[a]; ok {
			continue
		}
		ln, err := l.listenLocked(a, false)
		if err != nil {
			l.log.Warn("cannot listen on a storage NIC's address; subflows cannot join there", "addr", a.String(), "error", err)
			continue
		}
		l.follow[a] = ln
		l.log.Info("NBD port opened on a storage NIC's address", "addr", ln.Addr().String())
	}
}

// listenLocked binds the port on a and serves it if Serve was called.
func (l *Listeners) listenLocked(a netip.Addr, freeBind bool) (net.Listener, error) {
	if l.closed {
		return nil, errors.New("agent: listeners closed")
	}
	var lc net.ListenConfig
	lc.SetMultipathTCP(l.mptcp)
	if freeBind {
		lc.Control = freeBindControl(l.log)
	}
	addr := net.JoinHostPort(a.String(), strconv.Itoa(l.port))
	ln, err := lc.Listen(context.Background(), "tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("agent: listen on %s: %w", addr, err)
	}
	if l.port == 0 {
		if ta, ok := ln.Addr().(*net.TCPAddr); ok {
			l.port = ta.Port
		}
	}
	if l.serving {
		l.serveLocked(ln)
	}
	return ln, nil
}

func (l *Listeners) serveLocked(ln net.Listener) {
	l.wg.Go(func() {
		if err := l.srv.Serve(ln); err != nil && !errors.Is(err, nbd.ErrClosed) {
			l.log.Error("serving failed", "addr", ln.Addr().String(), "error", err)
		}
	})
}

// Serve starts serving every listener, and every later one as it comes.
func (l *Listeners) Serve() {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.serving || l.closed {
		return
	}
	l.serving = true
	for _, ln := range l.fixed {
		l.serveLocked(ln)
	}
	for _, ln := range l.follow {
		l.serveLocked(ln)
	}
}

// Port is the port every listener has (once one is bound).
func (l *Listeners) Port() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.port
}

// Addrs are the bound addresses (HOST:PORT), fixed ones first, each kind
// sorted.
func (l *Listeners) Addrs() []string {
	var out []string
	for _, ln := range l.Listeners() {
		out = append(out, ln.Addr().String())
	}
	return out
}

// Listeners returns the bound listeners in the order of Addrs.
func (l *Listeners) Listeners() []net.Listener {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []net.Listener
	for _, m := range []map[netip.Addr]net.Listener{l.fixed, l.follow} {
		keys := make([]netip.Addr, 0, len(m))
		for a := range m {
			keys = append(keys, a)
		}
		slices.SortFunc(keys, netip.Addr.Compare)
		for _, a := range keys {
			out = append(out, m[a])
		}
	}
	return out
}

// Close closes every listener (connections accepted stay) and waits for
// their Serve calls to return; later calls of Follow do nothing.
func (l *Listeners) Close() {
	l.mu.Lock()
	l.closed = true
	for _, m := range []map[netip.Addr]net.Listener{l.fixed, l.follow} {
		for a, ln := range m {
			ln.Close()
			delete(m, a)
		}
	}
	l.mu.Unlock()
	l.wg.Wait()
}
