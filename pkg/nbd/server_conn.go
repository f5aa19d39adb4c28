package nbd

import (
	"bufio"
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
// loop parses requests and hands each to its own goroutine; replies are
// written under a mutex, whole, in whatever order requests finish.
type serverConn struct {
	srv      *Server
	conn     net.Conn
	info     ConnInfo
	done     chan struct{}
	export   *Export
	log      *slog.Logger
	hsReader *bufio.Reader

	draining atomic.Bool
	inflight sync.WaitGroup

	wmu  sync.Mutex
	werr error
}

// drain makes the reader loop stop at the next request boundary; requests
// already read still complete and get their replies.
func (c *serverConn) drain() {
	c.draining.Store(true)
	c.conn.SetReadDeadline(time.Now())
}

func (c *serverConn) transmit() {
	maxReqs := c.srv.MaxInflight
	if maxReqs <= 0 {
		maxReqs = 256
	}
	maxBytes := c.srv.MaxInflightBytes
	if maxBytes <= 0 {
		maxBytes = 64 << 20
	}
	lim := newLimiter(maxReqs, maxBytes)
	var src io.Reader = c.conn
	if c.hsReader != nil {
		src = c.hsReader
	}
	r := bufio.NewReaderSize(src, 256<<10)
	e := c.export

	defer func() {
		c.inflight.Wait()
		if !e.ReadOnly {
			if err := e.Backend.Sync(); err != nil {
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
		switch {
		case req.Type == CmdDisc:
			c.log.Debug("client disconnected")
			return
		case req.Length > MaxRequestSize && (req.Type == CmdWrite || req.Type == CmdRead):
			c.log.Warn("request too big", "cmd", CmdName(req.Type), "length", req.Length)
			c.reply(req.Handle, EOVERFLOW, nil)
			if o := c.srv.Observer; o != nil {
				o.Request(e.Name, req.Type, 0, 0, EOVERFLOW)
			}
			if req.Type == CmdWrite {
				// Its payload follows and is too big to skip safely.
				return
			}
			continue
		}
		var payload int
		if req.Type == CmdWrite || req.Type == CmdRead {
			payload = int(req.Length)
		}
		lim.acquire(payload)
		var buf []byte
		if req.Type == CmdWrite {
			buf = getBuf(payload)
			if _, err := io.ReadFull(r, buf); err != nil {
				putBuf(buf)
				lim.release(payload)
				c.readEnded(err)
				return
			}
		}
		c.inflight.Add(1)
		go func() {
			defer c.inflight.Done()
			defer lim.release(payload)
			c.handle(req, buf)
		}()
	}
}

func (c *serverConn) readEnded(err error) {
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

func (c *serverConn) handle(req Request, buf []byte) {
	start := time.Now()
	errno, data := c.execute(req, buf)
	c.reply(req.Handle, errno, data)
	if data != nil {
		putBuf(data)
	}
	if buf != nil {
		putBuf(buf)
	}
	if o := c.srv.Observer; o != nil {
		n := 0
		if errno == 0 && (req.Type == CmdRead || req.Type == CmdWrite) {
			n = int(req.Length)
		}
		o.Request(c.export.Name, req.Type, n, time.Since(start), errno)
	}
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
			c.log.Error("read failed", "offset", off, "length", n, "error", err)
			putBuf(data)
			return EIO, nil
		}
		return 0, data

	case CmdWrite:
		if e.ReadOnly {
			return EPERM, nil
		}
		if !inRange {
			return ENOSPC, nil
		}
		if _, err := b.WriteAt(buf, off); err != nil {
			c.log.Error("write failed", "offset", off, "length", n, "error", err)
			return errnoOf(err), nil
		}
		return c.maybeSync(fua), nil

	case CmdFlush:
		return c.maybeSync(true), nil

	case CmdTrim, CmdWriteZeroes:
		if e.ReadOnly {
			return EPERM, nil
		}
		if !inRange {
			return EINVAL, nil
		}
		var err error
		if req.Type == CmdTrim {
			err = b.Trim(off, n)
		} else {
			err = b.Zero(off, n, req.Flags&CmdFlagNoHole != 0)
		}
		if err != nil {
			c.log.Error(CmdName(req.Type)+" failed", "offset", off, "length", n, "error", err)
			return errnoOf(err), nil
		}
		return c.maybeSync(fua), nil
	}
	return EINVAL, nil
}

func (c *serverConn) maybeSync(sync bool) uint32 {
	if !sync || c.export.ReadOnly {
		return 0
	}
	if err := c.export.Backend.Sync(); err != nil {
		c.log.Error("flush failed", "error", err)
		return EIO
	}
	return 0
}

func errnoOf(err error) uint32 {
	switch {
	case errors.Is(err, syscall.ENOSPC), errors.Is(err, syscall.EDQUOT):
		return ENOSPC
	case errors.Is(err, ErrOutOfRange):
		return EINVAL
	case errors.Is(err, syscall.EPERM), errors.Is(err, syscall.EROFS), errors.Is(err, syscall.EBADF):
		return EPERM
	}
	return EIO
}

// reply writes one simple reply (with data for a successful read). A write
// error closes the connection; later replies are dropped.
func (c *serverConn) reply(handle uint64, errno uint32, data []byte) {
	hdr := make([]byte, replyHeaderSize)
	(&Reply{Errno: errno, Handle: handle}).Encode(hdr)
	c.wmu.Lock()
	defer c.wmu.Unlock()
	if c.werr != nil {
		return
	}
	var err error
	if errno == 0 && len(data) > 0 {
		bufs := net.Buffers{hdr, data}
		_, err = bufs.WriteTo(c.conn)
	} else {
		_, err = c.conn.Write(hdr)
	}
	if err != nil {
		c.werr = err
		c.log.Info("reply failed, closing connection", "error", err)
		c.conn.Close()
	}
}

// limiter bounds requests and payload bytes in flight on one connection.
type limiter struct {
	mu       sync.Mutex
	cond     sync.Cond
	reqs     int
	bytes    int
	maxReqs  int
	maxBytes int
}

func newLimiter(maxReqs, maxBytes int) *limiter {
	l := &limiter{maxReqs: maxReqs, maxBytes: maxBytes}
	l.cond.L = &l.mu
	return l
}

func (l *limiter) acquire(n int) {
	n = min(n, l.maxBytes)
	l.mu.Lock()
	for l.reqs >= l.maxReqs || (l.bytes > 0 && l.bytes+n > l.maxBytes) {
		l.cond.Wait()
	}
	l.reqs++
	l.bytes += n
	l.mu.Unlock()
}

func (l *limiter) release(n int) {
	n = min(n, l.maxBytes)
	l.mu.Lock()
	l.reqs--
	l.bytes -= n
	l.mu.Unlock()
	l.cond.Broadcast()
}
