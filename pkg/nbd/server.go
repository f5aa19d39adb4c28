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
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"sync"
	"sync/atomic"
	"time"
)

// Export is one named block device served by a Server.
type Export struct {
	Name        string
	Description string
	Backend     Backend
	ReadOnly    bool
	// RequireTLS refuses the export (ERR_TLS_REQD) to connections that
	// did not upgrade with STARTTLS.
	RequireTLS bool
	// Ledger, when set, hears each connection's changes and settle marks
	// (CmdSettle, which the export then answers).
	Ledger Ledger

	mu       sync.Mutex
	conns    map[*serverConn]struct{}
	sessions map[sessionKey]*sessionSlot
	removed  bool
	// reserved counts the connections that chose the export and are not
	// closed yet, for Limits.MaxConnsPerExport.
	reserved int
	// gate: every change to the backend (write, trim, write-zeroes) runs
	// under its read lock, and is recorded in the change trackers before
	// the lock is released; Quiesce takes the write lock.
	gate sync.RWMutex
	// trackers are the running ChangeTrackers (nil for none), replaced
	// whole under trackMu.
	trackMu  sync.Mutex
	trackers atomic.Pointer[[]*ChangeTracker]
	// syncs runs the backend's syncs and keeps their failures for the
	// clients (syncerr.go).
	syncs exportSyncs
	// mem is the budget of the requests in flight of all its connections
	// (budget.go); made on first use, under mu.
	mem *budget
}

// Quiesce holds the export at a flush point: it waits for the changes in
// flight to reach the backend and syncs it, while changes that arrive
// meanwhile wait (they are held, not failed; reads go on). From then until
// resume is called, the backend holds every write the export acknowledged
// and none it will acknowledge later: what a crash-consistent snapshot
// copies. ctx bounds the wait for the changes in flight. resume may be
// called more than once.
func (e *Export) Quiesce(ctx context.Context) (resume func(), err error) {
	locked := make(chan struct{})
	go func() {
		e.gate.Lock()
		close(locked)
	}()
	select {
	case <-locked:
	case <-ctx.Done():
		go func() {
			<-locked
			e.gate.Unlock()
		}()
		return nil, fmt.Errorf("export %q: writes in flight did not finish: %w", e.Name, ctx.Err())
	}
	if err := e.Sync(); err != nil {
		e.gate.Unlock()
		return nil, fmt.Errorf("export %q: flush: %w", e.Name, err)
	}
	return sync.OnceFunc(e.gate.Unlock), nil
}

// Flags returns the transmission flags announced for the export.
func (e *Export) Flags() uint16 {
	return e.flags(false)
}

// flags returns the transmission flags for a connection; readOnly makes
// that connection read-only even on a writable export.
func (e *Export) flags(readOnly bool) uint16 {
	f := FlagHasFlags | FlagSendFlush | FlagSendFUA | FlagCanMultiConn
	if e.ReadOnly || readOnly {
		return f | FlagReadOnly
	}
	return f | FlagSendTrim | FlagSendWriteZeroes
}

// ConnInfo describes a client connection to authorization hooks and observers.
type ConnInfo struct {
	Conn       net.Conn
	RemoteAddr net.Addr
	LocalAddr  net.Addr
	// Requested is the export name the client asked for (set once
	// negotiation chose an export).
	Requested string
	// Tag is the Grant's tag when Server.Resolve chose the export, so that
	// CloseConns can select, e.g., the connections of one node.
	Tag string
	// TLS is the state of the connection's TLS session once the client
	// upgraded with STARTTLS (its peer certificates among it); nil before
	// and without.
	TLS *tls.ConnectionState
}

// Grant is what Server.Resolve decides for one connection.
type Grant struct {
	// Export is the name of the served export to open.
	Export string
	// ReadOnly makes this connection read-only: FlagReadOnly is announced
	// and writes, trims and write-zeroes fail with EPERM.
	ReadOnly bool
	// Tag is recorded in the connection's ConnInfo.
	Tag string
	// RequireTLS refuses the export (ERR_TLS_REQD) unless the connection
	// upgraded with STARTTLS.
	RequireTLS bool
	// Servers, when set, are the storage nodes that hold the export now,
	// sent to a client that asks (InfoServers).
	Servers []ServerAddrs
	// Info, when set, answers the information types of ours that a
	// client asks for and the server does not know itself (nil: none of
	// that type). The answer goes out as an NBD_REP_INFO after the type.
	Info func(typ uint16) []byte
}

// Observer receives events for metrics. Calls are made from the serving
// goroutines and must not block.
type Observer interface {
	ConnOpened(c ConnInfo, export string)
	ConnClosed(c ConnInfo, export string)
	Request(export string, cmd uint16, bytes int, d time.Duration, errno uint32)
}

// Server serves exports over any net.Listener. MPTCP, TCP or a UNIX socket
// is decided by how the listener was made.
type Server struct {
	// Logger receives structured logs; nil means slog.Default().
	Logger *slog.Logger
	// Authorize decides whether a connection may open an export. Nil allows
	// everything. An error refuses the export (ERR_POLICY during GO/INFO).
	Authorize func(c ConnInfo, export string) error
	// Resolve, when set, is consulted instead of the exports map and
	// Authorize: it maps the name a client asked for to the export to serve
	// and says whether this connection may only read. Its error refuses
	// the export with ERR_POLICY (or ERR_UNKNOWN if it wraps
	// ErrUnknownExport). Export names may then differ from the names
	// clients use, e.g. carry a per-client token: the server never logs
	// or repeats the name asked for, only Resolve's error.
	Resolve func(c ConnInfo, name string) (Grant, error)
	// DisableList refuses NBD_OPT_LIST (export names may carry secrets).
	DisableList bool
	// DefaultExport is served to clients that ask for the empty name.
	DefaultExport string
	// Observer, when set, gets connection and request events.
	Observer Observer
	// Limits bounds connections and handshakes; the zero value gives the
	// defaults. Set it before serving.
	Limits Limits
	// MaxInflightBytes bounds payload bytes held per connection; zero means
	// 64 MiB. With the request count limit it caps memory per client, so a
	// client that stops reading replies stalls only itself.
	MaxInflightBytes int
	// MaxInflightBytesPerExport and MaxInflightBytesPerSource bound what
	// the requests in flight of all connections to one export, and of all
	// connections from one source IP address, may hold (budget.go); zero
	// means DefaultMaxInflightBytesPerExport and
	// DefaultMaxInflightBytesPerSource, a negative value no bound.
	MaxInflightBytesPerExport, MaxInflightBytesPerSource int
	// MaxInflight bounds requests in flight per connection; zero means 256.
	MaxInflight int
	// Workers is the number of goroutines executing requests per
	// connection; zero means 16.
	Workers int
	// NoInline hands every request to a worker. By default the goroutine
	// reading a connection executes a write, or a read of 16 KiB or
	// more, itself while nothing else of the connection is in flight and
	// the backend is fast, which saves two goroutine wake-ups per request
	// of a stream.
	NoInline bool
	// inlineBase replaces the fixed part of an inline request's budget
	// (tests on a loaded machine).
	inlineBase time.Duration
	// TLSConfig, when set, offers NBD_OPT_STARTTLS: the connection upgrades
	// to TLS before the client chooses an export. TLS 1.2 is accepted (the
	// protocol requires it) with forward-secret AEAD suites only, unless
	// MinVersion asks for 1.3. ServerTLS makes one that checks client
	// certificates without ClientCAs, which GnuTLS clients with RSA keys
	// need. Without TLSConfig STARTTLS is unsupported.
	TLSConfig *tls.Config
	// TLSRequired makes every connection upgrade before anything else:
	// other options get ERR_TLS_REQD, NBD_OPT_EXPORT_NAME a hang-up.
	TLSRequired bool
	// Incarnation is announced to clients that send OptSession; zero means
	// one random value per process, so that every restart of the server
	// counts as a new incarnation. Set it to something that changes
	// exactly when writes not yet flushed can have been lost.
	Incarnation Incarnation
	// DeadPeerTimeout arms every connection against a client host that
	// falls silent (server_deadconn.go); zero means
	// DefaultDeadPeerTimeout, a negative value leaves the sockets as
	// they are.
	DeadPeerTimeout time.Duration

	mu        sync.Mutex
	exports   map[string]*Export
	listeners map[net.Listener]struct{}
	conns     map[*serverConn]struct{}
	closed    bool
	wg        sync.WaitGroup
	counts    connCounts
	// srcMem are the budgets of the sources with connections (budget.go).
	srcMem map[netip.Addr]*budget
}

func (s *Server) incarnation() Incarnation {
	s.mu.Lock()
	inc := s.Incarnation
	s.mu.Unlock()
	if inc != (Incarnation{}) {
		return inc
	}
	return processIncarnation()
}

func (s *Server) log() *slog.Logger {
	if s.Logger != nil {
		return s.Logger
	}
	return slog.Default()
}

// AddExport makes an export available to new connections.
func (s *Server) AddExport(e *Export) error {
	if e.Name == "" || len(e.Name) > maxNameLen {
		return fmt.Errorf("export name %q: %w", e.Name, ErrProtocol)
	}
	if e.Backend == nil {
		return fmt.Errorf("export %q has no backend", e.Name)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.exports == nil {
		s.exports = make(map[string]*Export)
	}
	if _, ok := s.exports[e.Name]; ok {
		return fmt.Errorf("export %q: %w", e.Name, ErrExportExists)
	}
	e.mu.Lock()
	e.conns = make(map[*serverConn]struct{})
	e.sessions = make(map[sessionKey]*sessionSlot)
	e.removed = false
	e.mu.Unlock()
	s.exports[e.Name] = e
	s.log().Info("export added", "export", e.Name, "size", e.Backend.Size(), "read_only", e.ReadOnly)
	return nil
}

// Export returns the export with the given name.
func (s *Server) Export(name string) (*Export, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	e, ok := s.exports[name]
	return e, ok
}

// Exports returns the names of all exports.
func (s *Server) Exports() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	names := make([]string, 0, len(s.exports))
	for n := range s.exports {
		names = append(names, n)
	}
	return names
}

// RemoveExport stops serving an export: new connections are refused at
// once; existing ones stop reading requests, finish those in flight, flush
// and close. It returns when they are all gone or ctx ends. The backend is
// not closed: it belongs to the caller.
func (s *Server) RemoveExport(ctx context.Context, name string) error {
	s.mu.Lock()
	e, ok := s.exports[name]
	if ok {
		delete(s.exports, name)
	}
	s.mu.Unlock()
	if !ok {
		return fmt.Errorf("export %q: %w", name, ErrUnknownExport)
	}
	e.mu.Lock()
	e.removed = true
	conns := make([]*serverConn, 0, len(e.conns))
	for c := range e.conns {
		conns = append(conns, c)
	}
	e.mu.Unlock()
	err := drainAll(ctx, conns)
	s.log().Info("export removed", "export", name, "connections_closed", len(conns))
	return err
}

// CloseConns drains the connections of an export for which match returns
// true (e.g. those of a node whose access was revoked).
func (s *Server) CloseConns(ctx context.Context, name string, match func(ConnInfo) bool) (int, error) {
	e, ok := s.Export(name)
	if !ok {
		return 0, fmt.Errorf("export %q: %w", name, ErrUnknownExport)
	}
	e.mu.Lock()
	var conns []*serverConn
	for c := range e.conns {
		if match(c.info) {
			conns = append(conns, c)
		}
	}
	e.mu.Unlock()
	return len(conns), drainAll(ctx, conns)
}

// ExportConns is the number of connections that chose an export named
// name and are not closed yet: those serving it, those between choosing it
// and their first request, and those of an export of that name that was
// removed (RemoveExport) but whose handlers have not finished. A caller
// that removed an export waits for zero before it destroys what the
// export's backend stood for.
func (s *Server) ExportConns(name string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := 0
	for c := range s.conns {
		if c.reserved != nil && c.reserved.Name == name {
			n++
		}
	}
	return n
}

func drainAll(ctx context.Context, conns []*serverConn) error {
	for _, c := range conns {
		c.drain()
	}
	for _, c := range conns {
		select {
		case <-c.done:
		case <-ctx.Done():
			// Out of patience: close hard, but still wait for the handlers
			// so the caller knows the backend is no longer in use.
			for _, c := range conns {
				c.sock.Close()
			}
			for _, c := range conns {
				<-c.done
			}
			return ctx.Err()
		}
	}
	return nil
}

// Serve accepts connections on l until l is closed or Shutdown is called.
func (s *Server) Serve(l net.Listener) error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return ErrClosed
	}
	if s.listeners == nil {
		s.listeners = make(map[net.Listener]struct{})
	}
	s.listeners[l] = struct{}{}
	s.mu.Unlock()
	defer func() {
		s.mu.Lock()
		delete(s.listeners, l)
		s.mu.Unlock()
	}()
	var backoff time.Duration
	for {
		c, err := l.Accept()
		if err != nil {
			s.mu.Lock()
			closed := s.closed
			s.mu.Unlock()
			if closed || errors.Is(err, net.ErrClosed) {
				return nil
			}
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				continue
			}
			// Temporary resource exhaustion (EMFILE...): back off, retry.
			backoff = min(max(2*backoff, 5*time.Millisecond), time.Second)
			s.log().Warn("accept failed", "error", err, "retry_in", backoff)
			time.Sleep(backoff)
			continue
		}
		backoff = 0
		// Count the connection in before anything is allocated for it:
		// one over a limit is closed at once.
		a, reason := s.admit(c.RemoteAddr())
		if a == nil {
			c.Close()
			s.refused(ConnInfo{Conn: c, RemoteAddr: c.RemoteAddr(), LocalAddr: c.LocalAddr()}, reason)
			continue
		}
		s.wg.Add(1)
		go func() {
			defer s.wg.Done()
			s.serveConn(c, a)
		}()
	}
}

// ServeConn runs negotiation and transmission on one connection and closes
// it when done. The connection counts towards the Limits: it is closed at
// once if it is over one.
func (s *Server) ServeConn(c net.Conn) {
	a, reason := s.admit(c.RemoteAddr())
	if a == nil {
		c.Close()
		s.refused(ConnInfo{Conn: c, RemoteAddr: c.RemoteAddr(), LocalAddr: c.LocalAddr()}, reason)
		return
	}
	s.serveConn(c, a)
}

// serveConn serves a connection admitted as a.
func (s *Server) serveConn(c net.Conn, a *admission) {
	defer s.release(a)
	sc := &serverConn{
		srv:  s,
		conn: c,
		sock: c,
		info: ConnInfo{Conn: c, RemoteAddr: c.RemoteAddr(), LocalAddr: c.LocalAddr()},
		done: make(chan struct{}),
	}
	defer close(sc.done)
	defer c.Close()
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return
	}
	if s.conns == nil {
		s.conns = make(map[*serverConn]struct{})
	}
	s.conns[sc] = struct{}{}
	s.mu.Unlock()
	defer func() {
		s.mu.Lock()
		delete(s.conns, sc)
		s.mu.Unlock()
	}()

	defer func() {
		if sc.reserved != nil {
			sc.reserved.unreserve()
		}
	}()

	log := s.log().With("remote", c.RemoteAddr().String())
	exp, err := s.negotiate(sc)
	s.handshakeDone(a)
	if err != nil {
		var ne net.Error
		switch {
		case errors.Is(err, errPerExport):
			log.Info("connection refused: too many connections to the export", "limit", s.Limits.resolve().perExport)
			s.refused(sc.info, RefusedPerExport)
		case errors.As(err, &ne) && ne.Timeout() && !sc.draining.Load():
			log.Info("handshake timed out")
			s.refused(sc.info, RefusedHandshakeTimeout)
		case !errors.Is(err, ErrAborted) && !isEOF(err):
			log.Info("negotiation failed", "error", err)
		}
		return
	}
	if !exp.attach(sc) {
		log.Info("export removed during negotiation", "export", exp.Name)
		return
	}
	defer exp.detach(sc)
	if !s.stillGranted(sc, exp) {
		log.Info("access revoked during negotiation", "export", exp.Name, "tag", sc.info.Tag)
		return
	}
	sc.export = exp
	sc.log = log.With("export", exp.Name)
	if exp.Ledger != nil {
		sc.ledger = exp.Ledger.Open(sc.info)
		defer sc.ledger.Close()
	}
	if sc.session != nil {
		if !exp.join(sc) {
			sc.log.Info("refusing a connection older than its session's current one", "session", sc.session.ID.String(), "lane", sc.session.Lane)
			return
		}
		defer exp.leave(sc)
	}
	exp.syncs.open(sc)
	defer exp.syncs.close(sc)
	if sc.draining.Load() {
		// Drained during negotiation, whose end cleared the read
		// deadline that was to stop the reader.
		return
	}
	if o := s.Observer; o != nil {
		o.ConnOpened(sc.info, exp.Name)
		defer o.ConnClosed(sc.info, exp.Name)
	}
	// Only now, with the client verified and its export granted, does a
	// TLS connection get the transport's read buffer.
	if bufferTLS(sc.conn) {
		serverTLSBuffers.Add(1)
	}
	sc.log.Debug("transmission started", "flags", exp.flags(sc.readOnly))
	sc.transmit()
}

// ConnCount is the number of connections in the transmission phase.
func (e *Export) ConnCount() int {
	e.mu.Lock()
	defer e.mu.Unlock()
	return len(e.conns)
}

func (e *Export) attach(c *serverConn) bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.removed {
		return false
	}
	e.conns[c] = struct{}{}
	return true
}

// join adds c to its session lane. It refuses c when a connection with a
// later generation sent requests already.
func (e *Export) join(c *serverConn) bool {
	k := sessionKey{c.session.ID, c.session.Lane}
	e.mu.Lock()
	defer e.mu.Unlock()
	sl := e.sessions[k]
	if sl == nil {
		sl = &sessionSlot{conns: make(map[*serverConn]struct{})}
		e.sessions[k] = sl
	}
	if c.session.Generation < sl.activeGen {
		return false
	}
	sl.conns[c] = struct{}{}
	return true
}

// activate is called before c sends its first request to the backend: it
// returns the connections of the lane that c supersedes (every one with an
// older generation). It refuses c when a connection with a later
// generation sent requests already.
func (e *Export) activate(c *serverConn) ([]*serverConn, bool) {
	k := sessionKey{c.session.ID, c.session.Lane}
	e.mu.Lock()
	defer e.mu.Unlock()
	sl := e.sessions[k]
	if c.session.Generation < sl.activeGen {
		return nil, false
	}
	sl.activeGen = c.session.Generation
	var older []*serverConn
	for o := range sl.conns {
		if o.session.Generation < c.session.Generation {
			older = append(older, o)
		}
	}
	return older, true
}

// leave takes c out of its session lane.
func (e *Export) leave(c *serverConn) {
	k := sessionKey{c.session.ID, c.session.Lane}
	e.mu.Lock()
	sl := e.sessions[k]
	delete(sl.conns, c)
	if len(sl.conns) == 0 {
		delete(e.sessions, k)
	}
	e.mu.Unlock()
}

func (e *Export) detach(c *serverConn) {
	e.mu.Lock()
	delete(e.conns, c)
	e.mu.Unlock()
}

// Shutdown stops accepting, drains every connection and waits for them
// (or for ctx, after which connections are closed hard).
func (s *Server) Shutdown(ctx context.Context) error {
	s.mu.Lock()
	s.closed = true
	for l := range s.listeners {
		l.Close()
	}
	conns := make([]*serverConn, 0, len(s.conns))
	for c := range s.conns {
		conns = append(conns, c)
	}
	s.mu.Unlock()
	err := drainAll(ctx, conns)
	s.wg.Wait()
	return err
}

// stillGranted asks Resolve again once a connection is attached to its
// export. A revocation (Resolve refusing from now on, then CloseConns)
// that happened between the first answer and the attach would otherwise
// miss the connection: CloseConns only sees attached ones.
func (s *Server) stillGranted(sc *serverConn, e *Export) bool {
	if s.Resolve == nil {
		return true
	}
	g, err := s.Resolve(sc.info, sc.info.Requested)
	return err == nil && g.Export == e.Name && (e.ReadOnly || g.ReadOnly) == sc.readOnly && g.Tag == sc.info.Tag
}

// lookup finds the export a client asked for and whether the connection
// is read-only, with the option error code to answer when it fails.
func (s *Server) lookup(c ConnInfo, name string) (*Export, Grant, uint32, error) {
	if name == "" {
		name = s.DefaultExport
	}
	if s.Resolve != nil {
		// The name a client asked for is not repeated: with Resolve it
		// may carry a credential (logs must not); Resolve's error says
		// what matters.
		g, err := s.Resolve(c, name)
		if err != nil {
			if errors.Is(err, ErrUnknownExport) {
				return nil, Grant{}, RepErrUnknown, err
			}
			return nil, Grant{}, RepErrPolicy, fmt.Errorf("%w: %w", ErrAccessDenied, err)
		}
		e, ok := s.Export(g.Export)
		if !ok {
			return nil, Grant{}, RepErrUnknown, fmt.Errorf("export %q: %w", g.Export, ErrUnknownExport)
		}
		return e, g, 0, nil
	}
	e, rep, err := s.lookupPlain(c, name)
	if err != nil {
		return nil, Grant{}, rep, err
	}
	return e, Grant{Export: e.Name}, 0, nil
}

func (s *Server) lookupPlain(c ConnInfo, name string) (*Export, uint32, error) {
	s.mu.Lock()
	e, ok := s.exports[name]
	s.mu.Unlock()
	if !ok {
		return nil, RepErrUnknown, fmt.Errorf("export %q: %w", name, ErrUnknownExport)
	}
	if s.Authorize != nil {
		if err := s.Authorize(c, name); err != nil {
			return nil, RepErrPolicy, fmt.Errorf("export %q: %w: %v", name, ErrAccessDenied, err)
		}
	}
	return e, 0, nil
}

func isEOF(err error) bool {
	return errors.Is(err, net.ErrClosed) || errors.Is(err, errEOF) || errors.Is(err, errUnexpectedEOF)
}
