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

package attach

import (
	"cmp"
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/mpnbd/mpnbd/internal/backoff"
	"github.com/mpnbd/mpnbd/pkg/mptcp"
	"github.com/mpnbd/mpnbd/pkg/nbd"
)

// minAddrTimeout is the least time one address gets before the next is
// tried: a path whose NIC is down answers nothing, and waiting the whole
// dial timeout on it would keep a volume from the paths that work.
const minAddrTimeout = 2 * time.Second

// AddrDialer dials a volume's server addresses in turn, starting with the
// one that worked last, so that a volume attaches and reconnects as long
// as any of its storage paths works. It is safe for concurrent use.
type AddrDialer struct {
	mu   sync.Mutex
	next int
}

// DialFunc dials and negotiates one address.
type DialFunc[T any] func(ctx context.Context, addr string) (T, error)

// Dial tries each of addrs once, from the last good one on, giving each a
// share of ctx's time (at least minAddrTimeout) and returns the first
// success. A refusal by the server (ErrServerRefused) ends the round at
// once: the other addresses reach the same server.
func Dial[T any](ctx context.Context, d *AddrDialer, addrs []string, dial DialFunc[T]) (T, string, error) {
	var zero T
	if len(addrs) == 0 {
		return zero, "", fmt.Errorf("%w: no server address", ErrInvalid)
	}
	d.mu.Lock()
	start := d.next % len(addrs)
	d.mu.Unlock()
	var errs []error
	for i := range addrs {
		k := (start + i) % len(addrs)
		actx, cancel := ctx, context.CancelFunc(func() {})
		if i < len(addrs)-1 {
			share := minAddrTimeout
			if dl, ok := ctx.Deadline(); ok {
				share = max(time.Until(dl)/time.Duration(len(addrs)-i), minAddrTimeout)
			}
			actx, cancel = context.WithTimeout(ctx, share)
		}
		v, err := dial(actx, addrs[k])
		cancel()
		if err == nil {
			d.mu.Lock()
			d.next = k
			d.mu.Unlock()
			return v, addrs[k], nil
		}
		errs = append(errs, err)
		if errors.Is(err, ErrServerRefused) || ctx.Err() != nil {
			break
		}
	}
	return zero, "", errors.Join(errs...)
}

// ExportDialer dials and negotiates data connections to an export: the one
// place where a transport's connections are made (MPTCP asked for and its
// fallback logged, the session announced, refusals told apart).
type ExportDialer struct {
	Logger *slog.Logger
	// TLS, when set, upgrades each connection (NBD_OPT_STARTTLS) before
	// the export is chosen; the connection returned is the TLS one.
	TLS *tls.Config
	// Servers, when set, asks the server which storage nodes hold the
	// export now (a replicated volume's replicas) and records its answer
	// there, for the next dials (ServerDialer.For).
	Servers *ServerDialer
}

// mptcpAttempts bounds the connections DialExport opens to get one that
// MPTCP carries, and mptcpRetryPause is the pause between them.
const (
	mptcpAttempts   = 3
	mptcpRetryPause = 200 * time.Millisecond
)

// connect opens a TCP connection to addr. Asked for MPTCP, a connection
// that fell back to plain TCP is closed and dialed again, up to
// mptcpAttempts times: a fallback is often a moment's (a SYN lost while
// the server restarts makes the kernel retry without MPTCP), and the
// connection would keep one path for its whole life. The last one is
// kept whatever it is: a network without MPTCP still gets its volume.
func (x ExportDialer) connect(ctx context.Context, d *net.Dialer, addr string, useMPTCP bool) (net.Conn, error) {
	for attempt := 1; ; attempt++ {
		c, err := d.DialContext(ctx, "tcp", addr)
		if err != nil {
			return nil, fmt.Errorf("dial %s: %w", addr, err)
		}
		if !useMPTCP || mptcp.IsMPTCP(c) {
			return c, nil
		}
		// No retry that could run out of time: a connection of one path
		// beats none.
		short := false
		if dl, ok := ctx.Deadline(); ok && time.Until(dl) < minAddrTimeout {
			short = true
		}
		if attempt >= mptcpAttempts || short || ctx.Err() != nil {
			if x.Logger != nil {
				x.Logger.Warn("MPTCP requested but the connection fell back to TCP", "remote", addr, "attempts", attempt)
			}
			return c, nil
		}
		c.Close()
		if x.Logger != nil {
			x.Logger.Info("MPTCP requested but the connection fell back to TCP: dialing again", "remote", addr, "attempt", attempt)
		}
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("dial %s: %w", addr, ctx.Err())
		case <-time.After(mptcpRetryPause):
		}
	}
}

// DialExport connects to addr (from the local address local, if set),
// with MPTCP when useMPTCP, and negotiates export announcing sess (none
// when nil). A refusal of the export by the server is ErrServerRefused.
func (x ExportDialer) DialExport(ctx context.Context, addr, local, export string, useMPTCP bool, sess *nbd.Session) (net.Conn, nbd.ExportInfo, error) {
	d := mptcp.Dialer(useMPTCP)
	if local != "" {
		la, err := net.ResolveTCPAddr("tcp", net.JoinHostPort(local, "0"))
		if err != nil {
			return nil, nbd.ExportInfo{}, fmt.Errorf("%w: local address %q: %v", ErrInvalid, local, err)
		}
		d.LocalAddr = la
	}
	c, err := x.connect(ctx, d, addr, useMPTCP)
	if err != nil {
		return nil, nbd.ExportInfo{}, err
	}
	no := nbd.NegotiateOptions{Session: sess, AskServers: x.Servers != nil}
	var info nbd.ExportInfo
	if x.TLS != nil {
		var tc net.Conn
		if tc, info, err = nbd.NegotiateConnTLS(ctx, c, export, x.TLS, no); err == nil {
			c = tc
		}
	} else {
		info, err = nbd.NegotiateConnWith(ctx, c, export, no)
	}
	if err != nil {
		c.Close()
		if errors.Is(err, nbd.ErrUnknownExport) || errors.Is(err, nbd.ErrAccessDenied) || errors.Is(err, nbd.ErrTLSRequired) {
			return nil, nbd.ExportInfo{}, fmt.Errorf("%w: %w", ErrServerRefused, err)
		}
		return nil, nbd.ExportInfo{}, fmt.Errorf("handshake with %s: %w", addr, err)
	}
	if x.Servers != nil && len(info.Servers) > 0 {
		if err := x.Servers.learn(info.Servers); err != nil {
			cmp.Or(x.Logger, slog.Default()).Warn("the storage nodes that hold the volume are not kept for the next process that serves it", "error", err)
		}
	}
	return c, info, nil
}

// ServerDialer remembers, for each server of a target, the address that
// answered last (an AddrDialer per server).
type ServerDialer struct {
	mu    sync.Mutex
	addrs map[string]*AddrDialer
	// learned are the servers that the last server to serve said hold
	// the export now (ExportDialer.Servers).
	learned []Server
	// file, when set, keeps learned for the next process (KeepIn).
	file string
}

// KeepIn makes d keep the servers it learns in the file path, and learn
// what the file holds: what an earlier process serving the volume
// learned. A process that serves a volume after another (a restart, an
// adopt, a handover, a resize's probe) then dials where the volume is now,
// not only the storage nodes it was published with: a drain or the
// replacement of a lost replica may have moved it to nodes it was never
// given. A missing file is no error; one that cannot be read is returned,
// and d starts from nothing learned.
func (d *ServerDialer) KeepIn(path string) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.file = path
	b, err := os.ReadFile(path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	var kept []Server
	if err := json.Unmarshal(b, &kept); err != nil {
		return fmt.Errorf("%s: %w", path, err)
	}
	kept = slices.DeleteFunc(kept, func(s Server) bool { return len(s.Addrs) == 0 })
	if len(d.learned) == 0 {
		d.learned = kept
	}
	return nil
}

// learn records the servers a serving server listed, and keeps them in
// d's file when they changed. A file that cannot be written is returned:
// the dials of this process go on with what was learned.
func (d *ServerDialer) learn(list []nbd.ServerAddrs) error {
	servers := make([]Server, len(list))
	for i, s := range list {
		servers[i] = Server{StorageNode: s.Node, Addrs: slices.Clone(s.Addrs)}
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	same := slices.EqualFunc(d.learned, servers, func(a, b Server) bool {
		return a.StorageNode == b.StorageNode && slices.Equal(a.Addrs, b.Addrs)
	})
	d.learned = servers
	if same || d.file == "" {
		return nil
	}
	b, err := json.Marshal(servers)
	if err != nil {
		return err
	}
	return WriteFileAtomic(d.file, b)
}

// WriteFileAtomic replaces path with b (mode 0600, its directory made
// 0700 if missing), through a temporary file renamed over it: a reader
// finds the old content or the new one.
func WriteFileAtomic(path string, b []byte) error {
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return err
	}
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, b, 0o600); err != nil {
		return err
	}
	if err := os.Rename(tmp, path); err != nil {
		os.Remove(tmp)
		return err
	}
	return nil
}

// For lists the servers to dial for t: those the last serving server
// listed (a replica added since the node was given t is among them), then
// those of t's own that it did not list (by name or address): a server
// that served before its list was updated may have left out a replica
// that has just joined, so the list given at publication is never
// dropped.
func (d *ServerDialer) For(t Target) []Server {
	d.mu.Lock()
	out := slices.Clone(d.learned)
	d.mu.Unlock()
	known := func(s Server) bool {
		for _, l := range out {
			if s.StorageNode != "" && s.StorageNode == l.StorageNode {
				return true
			}
			for _, a := range s.Addrs {
				if slices.Contains(l.Addrs, a) {
					return true
				}
			}
		}
		return false
	}
	for _, s := range t.Servers() {
		if !known(s) {
			out = append(out, s)
		}
	}
	return out
}

func (d *ServerDialer) of(s Server) *AddrDialer {
	d.mu.Lock()
	defer d.mu.Unlock()
	key := s.StorageNode
	if len(s.Addrs) > 0 {
		key += "/" + s.Addrs[0]
	}
	if d.addrs == nil {
		d.addrs = map[string]*AddrDialer{}
	}
	a := d.addrs[key]
	if a == nil {
		a = &AddrDialer{}
		d.addrs[key] = a
	}
	return a
}

// refusedRetryPause is the first pause before a server that refused is
// asked again within one DialServers round (doubling, to a second).
const refusedRetryPause = 200 * time.Millisecond

// DialServers dials a target's servers (Target.Servers) and returns what
// the first that serves the export gave, with its address. One server is
// dialled as Dial does; several are dialled at once, each over its
// addresses in turn: a replicated volume's replicas refuse the node at
// once while another is the primary, and a server that is gone must not
// hold up the one that took over; while a server is still dialled, one
// that refused is asked again (it may be promoted in the meantime). What
// another server gave too (two
// primaries for a moment, while one learns it was replaced) is handed to
// drop. A refusal as superseded (nbd.ErrSuperseded) by any server is in
// the error when none served: the node's grant was replaced.
func DialServers[T any](ctx context.Context, d *ServerDialer, servers []Server, dial func(ctx context.Context, s Server, addr string) (T, error), drop func(T)) (T, string, error) {
	if len(servers) == 1 {
		s := servers[0]
		return Dial(ctx, d.of(s), s.Addrs, func(ctx context.Context, addr string) (T, error) { return dial(ctx, s, addr) })
	}
	type result struct {
		v    T
		addr string
		err  error
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	ch := make(chan result, len(servers))
	// pending counts the servers still in their first dial, neither
	// answered nor failed: while one is (a host gone silent holds the
	// round until its timeout), a server that refused is asked again, as a
	// replica may be promoted meanwhile.
	var pending atomic.Int32
	pending.Store(int32(len(servers)))
	for _, s := range servers {
		go func() {
			first, wait := true, backoff.New(refusedRetryPause, time.Second)
			for {
				v, addr, err := Dial(ctx, d.of(s), s.Addrs, func(ctx context.Context, addr string) (T, error) { return dial(ctx, s, addr) })
				if first {
					pending.Add(-1)
					first = false
				}
				again := errors.Is(err, ErrServerRefused) && !errors.Is(err, nbd.ErrSuperseded) && pending.Load() > 0
				if again && backoff.Sleep(ctx, wait.Next()) != nil {
					again = false
				}
				if !again {
					if err != nil {
						err = fmt.Errorf("storage node %s: %w", s.StorageNode, err)
					}
					ch <- result{v, addr, err}
					return
				}
			}
		}()
	}
	var won *result
	var errs []error
	for range servers {
		r := <-ch
		switch {
		case r.err != nil:
			errs = append(errs, r.err)
		case won == nil:
			won = &r
			cancel()
		default:
			drop(r.v)
		}
	}
	if won != nil {
		return won.v, won.addr, nil
	}
	var zero T
	return zero, "", errors.Join(errs...)
}
