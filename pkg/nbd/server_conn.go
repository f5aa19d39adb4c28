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
	"bufio"
	"bytes"
	"errors"
	"io"
	"log/slog"
	"net"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
)

// serverConn is one client connection in the transmission phase. A reader
// loop parses requests and queues them to a small pool of workers; replies
// are queued as they finish, in any order, and whoever finds the queue idle
// writes everything queued in one writev.
type serverConn struct {
	srv  *Server
	conn net.Conn
	// sock is the accepted socket, which conn runs over once STARTTLS
	// replaced it: what other goroutines (Shutdown, CloseConns) stop the
	// connection through, since conn changes under them during a
	// handshake.
	sock     net.Conn
	info     ConnInfo
	done     chan struct{}
	export   *Export
	readOnly bool // the export is, or this connection was granted, read-only
	log      *slog.Logger
	hsReader *bufio.Reader
	// session is what the client announced with OptSession, if anything.
	session *Session
	// reserved is the export whose connection slot sc holds, if any;
	// written under srv.mu (read without it by sc's own goroutine).
	reserved *Export

	draining atomic.Bool
	// fenced is set once a newer connection of the same session lane
	// supersedes this one: requests not yet started are dropped.
	fenced atomic.Bool
	// gone is set once the connection ended under its requests (its
	// read failed, or a reply could not be written): requests not yet
	// started are dropped (server_deadconn.go).
	gone atomic.Bool
	// active: this connection sent a request and superseded the older
	// ones of its session lane (reader goroutine only).
	active bool
	// ledger is the export's Ledger's view of this connection (nil
	// without one).
	ledger LedgerConn
	// errCursor is the export's sync failure count this connection's
	// FLUSHes have reported up to (guarded by export.syncs.mu).
	errCursor uint64
	inline    inlineRequests
	inflight  sync.WaitGroup
	lim       *limiter

	qmu     sync.Mutex
	queue   []queuedReply
	spare   []queuedReply
	writing bool
	werr    error
	bufs    net.Buffers
	hdrs    []byte
	// tlsw gathers a batch into full TLS records on a connection that
	// upgraded with STARTTLS (a writev of headers and payloads would
	// become one record each).
	tlsw *bufio.Writer
}

// work is one request handed to a worker.
type work struct {
	req     Request
	buf     []byte // write payload
	payload int    // bytes charged to the limiter
	start   time.Time
}

// queuedReply is a finished request waiting to be written.
type queuedReply struct {
	handle  uint64
	errno   uint32
	data    []byte // read payload (pooled)
	payload int
}

// drain makes the reader loop stop at the next request boundary; requests
// already read still complete and get their replies.
func (c *serverConn) drain() {
	c.draining.Store(true)
	c.sock.SetReadDeadline(time.Now())
}

// defaultWorkers is the per-connection worker count: enough to keep a
// file backend busy at the kernel client's queue depths, few enough that
// their stacks stay warm.
const defaultWorkers = 16

func (c *serverConn) transmit() {
	maxReqs := c.srv.MaxInflight
	if maxReqs <= 0 {
		maxReqs = 256
	}
	maxBytes := c.srv.MaxInflightBytes
	if maxBytes <= 0 {
		maxBytes = 64 << 20
	}
	c.lim = newLimiter(maxReqs, maxBytes)
	if b := c.srv.exportBudget(c.export); b != nil {
		c.lim.shared = append(c.lim.shared, b)
	}
	if b, done := c.srv.sourceBudget(c.info.RemoteAddr); b != nil {
		c.lim.shared = append(c.lim.shared, b)
		defer done()
	}
	c.srv.armDeadPeer(c)
	lc := newLowatConn(c.conn)
	lc.stopping = c.draining.Load
	var src io.Reader = lc
	if c.hsReader != nil && c.hsReader.Buffered() > 0 {
		pre, _ := c.hsReader.Peek(c.hsReader.Buffered())
		src = io.MultiReader(bytes.NewReader(append([]byte(nil), pre...)), lc)
		// Bytes read ahead make the count of bytes still to come from the
		// socket uncertain; a wrong low-water mark would stall.
		lc.disable()
	}
	r := bufio.NewReaderSize(src, 256<<10)
	e := c.export
	c.inline = inlineRequests{off: c.srv.NoInline, base: inlineBase}
	if c.srv.inlineBase > 0 {
		c.inline.base = c.srv.inlineBase
	}

	workers := c.srv.Workers
	if workers <= 0 {
		workers = defaultWorkers
	}
	queue := make(chan work, maxReqs)
	for i := 0; i < workers; i++ {
		go c.worker(queue)
	}
	defer func() {
		close(queue)
		c.inflight.Wait()
		if !c.readOnly {
			if err := e.Sync(); err != nil {
				c.log.Error("flush on disconnect failed", "error", err)
			}
		}
	}()

	var hdr [requestHeaderSize]byte
	for {
		if _, err := io.ReadFull(r, hdr[:]); err != nil {
			c.readEnded(err)
			return
		}
		req, err := DecodeRequest(hdr[:])
		if err != nil {
			// Framing is lost: nothing after this can be trusted.
			c.log.Warn("closing connection", "error", err)
			return
		}
		if c.session != nil && !c.active && req.Type != CmdDisc {
			if !c.takeOver() {
				return
			}
		}
		if c.ledger != nil && (req.Type == CmdWrite || req.Type == CmdTrim || req.Type == CmdWriteZeroes) {
			c.ledger.Changed(req.Offset, uint64(req.Length))
		}
		switch {
		case req.Type == CmdDisc:
			c.log.Debug("client disconnected")
			return
		case req.Type == CmdSettle:
			// Answered here, in the connection's order.
			errno := EINVAL
			if c.ledger != nil && uint64(req.Length) < req.Offset {
				c.ledger.Settled(req.Offset, uint64(req.Length))
				errno = 0
			}
			c.lim.acquire(0)
			c.inflight.Add(1)
			c.reply(queuedReply{handle: req.Handle, errno: errno})
			continue
		case req.Length > MaxRequestSize && (req.Type == CmdWrite || req.Type == CmdRead):
			c.log.Warn("request too big", "cmd", CmdName(req.Type), "length", req.Length)
			c.lim.acquire(0)
			c.inflight.Add(1)
			c.reply(queuedReply{handle: req.Handle, errno: EOVERFLOW})
			if o := c.srv.Observer; o != nil {
				o.Request(e.Name, req.Type, 0, 0, EOVERFLOW)
			}
			if req.Type == CmdWrite {
				// Its payload follows and is too big to skip safely.
				return
			}
			continue
		}
		w := work{req: req, start: time.Now(), payload: requestCharge(req)}
		idle := c.lim.acquire(w.payload)
		if req.Type == CmdWrite {
			w.buf = getBuf(int(req.Length))
			if rest := int(req.Length) - r.Buffered(); rest > 0 {
				// Wake up only when most of the payload is there.
				lc.expect(rest)
			}
			_, err := io.ReadFull(r, w.buf)
			lc.expect(0)
			if err != nil {
				putBuf(w.buf)
				c.lim.release(w.payload)
				c.readEnded(err)
				return
			}
		}
		c.inflight.Add(1)
		if idle && c.inline.ok(w) {
			begin := time.Now()
			c.inline.took(w, begin, c.run(w))
			continue
		}
		queue <- w
	}
}

func (c *serverConn) worker(queue <-chan work) {
	for w := range queue {
		c.run(w)
	}
}

// run executes one request and queues its reply; it returns when the
// backend call ended.
func (c *serverConn) run(w work) time.Time {
	if c.fenced.Load() || c.gone.Load() {
		// Superseded, or the connection ended: the client sends this
		// request again on another connection, which must not meet it
		// executing late.
		if w.buf != nil {
			putBuf(w.buf)
		}
		c.drop(w.payload)
		return time.Now()
	}
	errno, data := c.execute(w.req, w.buf)
	end := time.Now()
	if w.buf != nil {
		putBuf(w.buf)
	}
	if errno == errnoWithheld {
		c.withhold(w.payload)
		return end
	}
	c.reply(queuedReply{handle: w.req.Handle, errno: errno, data: data, payload: w.payload})
	if o := c.srv.Observer; o != nil {
		n := 0
		if errno == 0 && (w.req.Type == CmdRead || w.req.Type == CmdWrite) {
			n = int(w.req.Length)
		}
		// A request's latency runs until its reply is queued or written.
		o.Request(c.export.Name, w.req.Type, n, time.Since(w.start), errno)
	}
	return end
}

// inlineRequests decides when the reader executes a request itself
// instead of handing it to a worker. Handing over costs a wake-up of the
// worker and of the reader per request, most of what a streamed request
// costs the server beyond the copies; executing inline costs the
// connection the reading of the requests behind it for as long as the
// backend takes and, for a read, until its reply is in the socket. So the
// reader executes a request only when nothing else of the connection is
// in flight (a stream, one request after the other's reply: a mixed load
// keeps its parallelism, and the reader never writes a reply but its own),
// only a write that asks for no FUA (a sync) or a read of at least
// inlineReadMin bytes (small replies are cheaper sent by the workers,
// several in one system call, above all on MPTCP), and only while the
// backend is fast: a request that takes longer than its budget sends the
// requests of the next second to the workers. Reader goroutine only.
type inlineRequests struct {
	off        bool // Server.NoInline
	base       time.Duration
	pausedTill time.Time
}

// inlineBase and inlineRate make a request's budget: a fixed part for the
// system call and the rate under which a backend counts as slow.
// inlineReadMin is the smallest read executed inline.
const (
	inlineBase    = 500 * time.Microsecond
	inlineRate    = 1 << 30 // bytes per second
	inlinePause   = time.Second
	inlineReadMin = 16 << 10
)

func (p *inlineRequests) ok(w work) bool {
	if p.off || w.req.Flags&CmdFlagFUA != 0 {
		return false
	}
	switch {
	case w.req.Type == CmdWrite:
	case w.req.Type == CmdRead && w.req.Length >= inlineReadMin:
	default:
		return false
	}
	return p.pausedTill.IsZero() || w.start.After(p.pausedTill)
}

// took records how long an inline request took in the backend.
func (p *inlineRequests) took(w work, begin, end time.Time) {
	budget := p.base + time.Duration(int64(w.req.Length)*int64(time.Second)/inlineRate)
	if end.Sub(begin) > budget {
		p.pausedTill = end.Add(inlinePause)
	}
}

// takeOver runs before the first request of a session connection: it
// supersedes the older connections of its session lane and waits until
// nothing of them runs any more, so that the request cannot meet a late
// one of theirs in the backend. It returns false when this connection
// must not serve (a later one sent requests already, or superseded this
// one meanwhile).
func (c *serverConn) takeOver() bool {
	c.active = true
	older, ok := c.export.activate(c)
	if !ok {
		c.log.Info("refusing requests of a connection a later one of its session replaced", "session", c.session.ID.String(), "lane", c.session.Lane)
		return false
	}
	for _, o := range older {
		o.fence()
	}
	// Even if this connection is superseded meanwhile: a chain of
	// replacements stays ordered.
	for _, o := range older {
		<-o.done
	}
	if len(older) > 0 {
		c.log.Info("superseded older connections of the session", "session", c.session.ID.String(), "lane", c.session.Lane, "connections", len(older))
	}
	return !c.fenced.Load()
}

// fence stops a superseded connection: it reads nothing more, starts no
// request it holds and sends no reply. Requests already executing finish;
// done is closed once they have.
func (c *serverConn) fence() {
	c.fenced.Store(true)
	c.conn.Close()
}

// drop releases a request that will get no reply.
func (c *serverConn) drop(payload int) {
	c.lim.release(payload)
	c.inflight.Done()
}

func (c *serverConn) readEnded(err error) {
	c.abandon()
	if c.fenced.Load() {
		c.log.Info("connection superseded by a newer one of its session")
		return
	}
	if c.draining.Load() {
		c.log.Debug("connection drained")
		return
	}
	if errors.Is(err, io.EOF) || errors.Is(err, net.ErrClosed) {
		c.log.Debug("connection closed by peer")
		return
	}
	c.log.Info("connection read failed", "error", err)
}

// execute performs one request against the backend. It never touches a
// byte outside [0, size): every range is checked first, overflow-safe.
func (c *serverConn) execute(req Request, buf []byte) (uint32, []byte) {
	e := c.export
	b := e.Backend
	size := uint64(b.Size())
	inRange := req.Length > 0 && req.Offset <= size && uint64(req.Length) <= size-req.Offset
	fua := req.Flags&CmdFlagFUA != 0
	off, n := int64(req.Offset), int64(req.Length)

	switch req.Type {
	case CmdRead:
		if !inRange {
			return EINVAL, nil
		}
		data := getBuf(int(req.Length))
		if _, err := b.ReadAt(data, off); err != nil {
			putBuf(data)
			if errors.Is(err, ErrWithheld) {
				return errnoWithheld, nil
			}
			c.log.Error("read failed", "offset", off, "length", n, "error", err)
			return EIO, nil
		}
		return 0, data

	case CmdWrite:
		if c.readOnly {
			return EPERM, nil
		}
		if !inRange {
			return ENOSPC, nil
		}
		mark := c.syncMark(fua)
		e.gate.RLock()
		_, err := b.WriteAt(buf, off)
		// Recorded after the backend call, failed or not (part of it may
		// have been written): see ChangeTracker.
		e.changed(off, n)
		e.gate.RUnlock()
		if err != nil {
			c.log.Error("write failed", "offset", off, "length", n, "error", err)
			return errnoOf(err), nil
		}
		return c.syncFUA(fua, mark), nil

	case CmdFlush:
		return c.flush(), nil

	case CmdTrim, CmdWriteZeroes:
		if c.readOnly {
			return EPERM, nil
		}
		if !inRange {
			return EINVAL, nil
		}
		var err error
		mark := c.syncMark(fua)
		e.gate.RLock()
		if req.Type == CmdTrim {
			err = b.Trim(off, n)
		} else {
			err = b.Zero(off, n, req.Flags&CmdFlagNoHole != 0)
		}
		e.changed(off, n)
		e.gate.RUnlock()
		if err != nil {
			c.log.Error(CmdName(req.Type)+" failed", "offset", off, "length", n, "error", err)
			return errnoOf(err), nil
		}
		return c.syncFUA(fua, mark), nil
	}
	return EINVAL, nil
}

// syncMark samples the export's sync failures before a FUA request
// changes the backend.
func (c *serverConn) syncMark(fua bool) uint64 {
	if !fua {
		return 0
	}
	return c.export.syncs.sample()
}

// syncFUA makes a FUA request durable: it fails when a sync failed since
// the request began (its data may be among what was lost).
func (c *serverConn) syncFUA(fua bool, mark uint64) uint32 {
	if !fua || c.readOnly {
		return 0
	}
	if err := c.export.Sync(); errors.Is(err, ErrWithheld) {
		return errnoWithheld
	} else if err != nil {
		c.log.Error("flush of a FUA request failed", "error", err)
	}
	if c.export.syncs.failedSince(mark) {
		return EIO
	}
	return 0
}

// flush answers a FLUSH: it fails when its own sync fails, and also when
// any sync of the export failed since this connection was last told of
// one (exportSyncs).
func (c *serverConn) flush() uint32 {
	if c.readOnly {
		return 0
	}
	if err := c.export.Sync(); errors.Is(err, ErrWithheld) {
		return errnoWithheld
	} else if err != nil {
		c.log.Error("flush failed", "error", err)
	}
	if c.export.syncs.report(c) {
		return EIO
	}
	return 0
}

func errnoOf(err error) uint32 {
	switch {
	case errors.Is(err, ErrWithheld):
		return errnoWithheld
	case errors.Is(err, syscall.ENOSPC), errors.Is(err, syscall.EDQUOT):
		return ENOSPC
	case errors.Is(err, ErrOutOfRange):
		return EINVAL
	case errors.Is(err, syscall.EPERM), errors.Is(err, syscall.EROFS), errors.Is(err, syscall.EBADF):
		return EPERM
	}
	return EIO
}

// reply queues one simple reply (with data for a successful read). If no
// one is writing, the caller writes the whole queue, batch after batch,
// in one writev each, so replies finishing together share a system call.
// A write error closes the connection; later replies are dropped. Buffers
// and limiter charges are released once a reply is written or dropped.
func (c *serverConn) reply(r queuedReply) {
	c.qmu.Lock()
	c.queue = append(c.queue, r)
	if c.writing {
		c.qmu.Unlock()
		return
	}
	c.writing = true
	for len(c.queue) > 0 {
		batch := c.queue
		c.queue = c.spare[:0]
		werr := c.werr
		c.qmu.Unlock()

		if werr == nil {
			werr = c.writeBatch(batch)
		}
		for i := range batch {
			if batch[i].data != nil {
				putBuf(batch[i].data)
			}
			c.lim.release(batch[i].payload)
			c.inflight.Done()
			batch[i] = queuedReply{}
		}

		c.qmu.Lock()
		if werr != nil && c.werr == nil {
			c.gone.Store(true)
			c.werr = werr
			c.log.Info("reply failed, closing connection", "error", werr)
			c.conn.Close()
		}
		c.spare = batch[:0]
	}
	c.writing = false
	c.qmu.Unlock()
}

// writeBatch writes replies with one writev. Only the current writer calls
// it, so the header and iovec scratch space is not shared.
func (c *serverConn) writeBatch(batch []queuedReply) error {
	if cap(c.hdrs) < len(batch)*replyHeaderSize {
		c.hdrs = make([]byte, len(batch)*replyHeaderSize)
	}
	hdrs := c.hdrs[:len(batch)*replyHeaderSize]
	bufs := c.bufs[:0]
	for i, r := range batch {
		h := hdrs[i*replyHeaderSize : (i+1)*replyHeaderSize]
		(&Reply{Errno: r.errno, Handle: r.handle}).Encode(h)
		bufs = append(bufs, h)
		if r.errno == 0 && len(r.data) > 0 {
			bufs = append(bufs, r.data)
		}
	}
	keep := bufs
	var err error
	if c.info.TLS != nil {
		if c.tlsw == nil {
			c.tlsw = bufio.NewWriterSize(c.conn, tlsRecord)
		}
		err = Batched(c.conn, func() error {
			for _, b := range bufs {
				if _, err := c.tlsw.Write(b); err != nil {
					return err
				}
			}
			return c.tlsw.Flush()
		})
	} else {
		_, err = bufs.WriteTo(c.conn)
	}
	c.bufs = keep[:0]
	return err
}

// tlsRecord is the largest TLS record's plaintext.
const tlsRecord = 16 << 10

// limiter bounds requests and the bytes they hold in flight on one
// connection, and charges the budgets it shares with other connections.
type limiter struct {
	mu       sync.Mutex
	cond     sync.Cond
	reqs     int
	bytes    int
	maxReqs  int
	maxBytes int
	// shared are the export's and the source's budgets (budget.go).
	shared []*budget
}

func newLimiter(maxReqs, maxBytes int) *limiter {
	l := &limiter{maxReqs: maxReqs, maxBytes: maxBytes}
	l.cond.L = &l.mu
	return l
}

// acquire charges one request of n bytes, waiting for room on the
// connection and then in the shared budgets; it reports whether nothing
// else was in flight. Only the connection's reader calls it, so the room
// found on the connection stays while it waits for the shared budgets, and
// a request waiting holds nothing.
func (l *limiter) acquire(n int) bool {
	n = min(n, l.maxBytes)
	l.mu.Lock()
	for l.reqs >= l.maxReqs || (l.bytes > 0 && l.bytes+n > l.maxBytes) {
		l.cond.Wait()
	}
	l.mu.Unlock()
	for _, b := range l.shared {
		b.acquire(n)
	}
	l.mu.Lock()
	idle := l.reqs == 0
	l.reqs++
	l.bytes += n
	l.mu.Unlock()
	return idle
}

func (l *limiter) release(n int) {
	n = min(n, l.maxBytes)
	for _, b := range l.shared {
		b.release(n)
	}
	l.mu.Lock()
	l.reqs--
	l.bytes -= n
	l.mu.Unlock()
	l.cond.Broadcast()
}
