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
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"github.com/mpnbd/mpnbd/pkg/mptcp"
	"io"
	"log/slog"
	"net"
	"sync"
	"sync/atomic"
)

// DialOptions configures Dial.
type DialOptions struct {
	Network string // "tcp" unless set
	Addr    string
	Export  string
	// Conns is the number of connections (1 unless set). More than one
	// needs a server that announces NBD_FLAG_CAN_MULTI_CONN.
	Conns int
	// MPTCP dials with multipath TCP. A silent fallback to plain TCP is
	// logged and visible in Client.MultipathTCP.
	MPTCP bool
	// Dialer is copied and used for every connection; nil means a default.
	Dialer *net.Dialer
	Logger *slog.Logger
	// AskInfos asks for information types of ours (ExportInfo.Infos of
	// Client.Info has the answers of the first connection).
	AskInfos []uint16
	// Session, when set, is announced on every connection (connection i
	// as lane i, each with a new generation), so that a server that knows
	// sessions fences the connections of an earlier dial of the same ID.
	Session *SessionID
	// TLS, when set, upgrades every connection with NBD_OPT_STARTTLS
	// (TLS 1.2 at least, forward-secret AEAD suites only; set MinVersion
	// for 1.3) before the export is chosen.
	TLS *tls.Config
}

// Client is a pipelined NBD client over one or more connections to one
// export. It is safe for concurrent use: callers issue requests from many
// goroutines and they travel together on the wire.
type Client struct {
	info   ExportInfo
	conns  []*clientConn
	rt     RoundTripper
	next   atomic.Uint64
	handle atomic.Uint64
	maxReq int
	log    *slog.Logger
}

// Dial connects, negotiates and returns a client.
func Dial(ctx context.Context, o DialOptions) (*Client, error) {
	n := max(o.Conns, 1)
	network := o.Network
	if network == "" {
		network = "tcp"
	}
	var d net.Dialer
	if o.Dialer != nil {
		d = *o.Dialer
	}
	if o.MPTCP {
		d.SetMultipathTCP(true)
	}
	log := o.Logger
	if log == nil {
		log = slog.Default()
	}
	var conns []net.Conn
	var info ExportInfo
	fail := func(err error) (*Client, error) {
		for _, c := range conns {
			c.Close()
		}
		return nil, err
	}
	for i := 0; i < n; i++ {
		c, err := d.DialContext(ctx, network, o.Addr)
		if err != nil {
			return fail(err)
		}
		conns = append(conns, c)
		if o.MPTCP && !IsMultipathTCP(c) {
			log.Warn("MPTCP requested but the connection fell back to TCP", "remote", o.Addr, "conn", i)
		}
		no := NegotiateOptions{AskInfos: o.AskInfos}
		if o.Session != nil {
			no.Session = &Session{ID: *o.Session, Lane: uint32(i), Generation: NextGeneration()}
		}
		var ci ExportInfo
		if o.TLS != nil {
			var tc net.Conn
			tc, ci, err = NegotiateConnTLS(ctx, c, o.Export, o.TLS, no)
			if err == nil {
				conns[len(conns)-1] = tc
			}
		} else {
			ci, err = NegotiateConnWith(ctx, c, o.Export, no)
		}
		if err != nil {
			return fail(err)
		}
		if i == 0 {
			info = ci
			if n > 1 && info.Flags&FlagCanMultiConn == 0 {
				return fail(fmt.Errorf("%w: %d connections requested but the server does not allow multi-conn", ErrUnsupported, n))
			}
		}
	}
	cl := NewClient(info, conns, log)
	return cl, nil
}

// IsMultipathTCP reports whether c is a TCP connection really carried by
// MPTCP (false after a fallback to plain TCP, or for other socket types).
// A TLS connection (and its transport) is looked through.
func IsMultipathTCP(c net.Conn) bool { return mptcp.IsMPTCP(c) }

// NewClient starts a client on connections that already finished
// negotiation for the export described by info.
func NewClient(info ExportInfo, conns []net.Conn, log *slog.Logger) *Client {
	cl := newClient(info, log)
	for _, c := range conns {
		_, isTLS := c.(*tls.Conn)
		cc := &clientConn{conn: c, tls: isTLS, pending: make(map[uint64]*call), r: bufio.NewReaderSize(c, 256<<10)}
		cl.conns = append(cl.conns, cc)
		go cc.readLoop()
	}
	return cl
}

// RoundTripper carries the requests of a Client that does not own its
// connections (a session that redials and replays, for instance). It must
// be safe for concurrent use; an error reply is an *Error.
type RoundTripper interface {
	RoundTrip(req Request, payload, dst []byte) error
	Close() error
}

// NewClientOn returns a client for the export described by info whose
// requests go through rt.
func NewClientOn(info ExportInfo, rt RoundTripper, log *slog.Logger) *Client {
	cl := newClient(info, log)
	cl.rt = rt
	return cl
}

func newClient(info ExportInfo, log *slog.Logger) *Client {
	if log == nil {
		log = slog.Default()
	}
	cl := &Client{info: info, log: log, maxReq: MaxRequestSize}
	if info.MaxBlock > 0 && int(info.MaxBlock) < cl.maxReq {
		cl.maxReq = int(info.MaxBlock)
	}
	return cl
}

// Info returns what negotiation told about the export.
func (cl *Client) Info() ExportInfo { return cl.info }

// Size is the export size in bytes.
func (cl *Client) Size() int64 { return int64(cl.info.Size) }

// Conns returns the underlying connections (for metrics such as MPTCP_INFO).
func (cl *Client) Conns() []net.Conn {
	out := make([]net.Conn, len(cl.conns))
	for i, c := range cl.conns {
		out[i] = c.conn
	}
	return out
}

// MultipathTCP reports, per connection, whether it is carried by MPTCP.
func (cl *Client) MultipathTCP() []bool {
	out := make([]bool, len(cl.conns))
	for i, c := range cl.conns {
		out[i] = IsMultipathTCP(c.conn)
	}
	return out
}

// ReadAt reads len(p) bytes at off, split into requests the server
// accepts. A range that is not aligned to the server's minimum block size
// is read rounded out to whole blocks.
func (cl *Client) ReadAt(p []byte, off int64) (int, error) {
	if lo, hi := cl.alignOut(off, int64(len(p))); lo != off || hi != off+int64(len(p)) {
		tmp := make([]byte, hi-lo)
		if _, err := cl.ReadAt(tmp, lo); err != nil {
			return 0, err
		}
		return copy(p, tmp[off-lo:]), nil
	}
	return cl.chunked(p, off, func(b []byte, o int64) error {
		return cl.do(Request{Type: CmdRead, Offset: uint64(o), Length: uint32(len(b))}, nil, b)
	})
}

// WriteAt writes p at off.
func (cl *Client) WriteAt(p []byte, off int64) (int, error) {
	return cl.WriteAtFlags(p, off, 0)
}

// WriteAtFlags writes p at off with command flags (CmdFlagFUA). Ranges not
// aligned to the server's minimum block size are refused with ErrUnaligned
// rather than emulated: a read-modify-write would not be atomic.
func (cl *Client) WriteAtFlags(p []byte, off int64, flags uint16) (int, error) {
	if err := cl.checkAligned(off, int64(len(p))); err != nil {
		return 0, err
	}
	return cl.chunked(p, off, func(b []byte, o int64) error {
		return cl.do(Request{Type: CmdWrite, Flags: flags, Offset: uint64(o), Length: uint32(len(b))}, b, nil)
	})
}

// OneRequest reports whether a write of n bytes at off goes to the server
// as one request as it is: aligned to the minimum block size and within
// the maximum.
func (cl *Client) OneRequest(off, n int64) bool {
	return cl.checkAligned(off, n) == nil && n <= int64(cl.maxReq)
}

func (cl *Client) minBlock() int64 { return max(int64(cl.info.MinBlock), 1) }

func (cl *Client) alignOut(off, n int64) (lo, hi int64) {
	m := cl.minBlock()
	lo = off - off%m
	hi = off + n
	if r := hi % m; r != 0 {
		hi += m - r
	}
	return lo, hi
}

func (cl *Client) checkAligned(off, n int64) error {
	if m := cl.minBlock(); off%m != 0 || n%m != 0 {
		return fmt.Errorf("%w: %d bytes at %d with a minimum block size of %d", ErrUnaligned, n, off, m)
	}
	return nil
}

// Flush asks the server to make every completed write durable.
func (cl *Client) Flush() error {
	return cl.do(Request{Type: CmdFlush}, nil, nil)
}

// Trim discards a range.
func (cl *Client) Trim(off, length int64) error {
	return cl.ranged(CmdTrim, 0, off, length)
}

// TrimFlags discards a range with request flags (CmdFlagFUA: durable once
// answered).
func (cl *Client) TrimFlags(off, length int64, flags uint16) error {
	return cl.ranged(CmdTrim, flags, off, length)
}

// WriteZeroes zeroes a range; noHole keeps it allocated.
func (cl *Client) WriteZeroes(off, length int64, noHole bool) error {
	var f uint16
	if noHole {
		f = CmdFlagNoHole
	}
	return cl.ranged(CmdWriteZeroes, f, off, length)
}

// WriteZeroesFlags zeroes a range with request flags (CmdFlagNoHole,
// CmdFlagFUA).
func (cl *Client) WriteZeroesFlags(off, length int64, flags uint16) error {
	return cl.ranged(CmdWriteZeroes, flags, off, length)
}

func (cl *Client) ranged(cmd, flags uint16, off, length int64) error {
	if err := cl.checkAligned(off, length); err != nil {
		return err
	}
	// Trim is bounded only by the 32-bit length; write-zeroes also by the
	// maximum block size.
	step := int64(1 << 30)
	if cmd == CmdWriteZeroes {
		step = int64(cl.maxReq)
	}
	step -= step % cl.minBlock()
	for length > 0 {
		n := min(length, step)
		if err := cl.do(Request{Type: cmd, Flags: flags, Offset: uint64(off), Length: uint32(n)}, nil, nil); err != nil {
			return err
		}
		off += n
		length -= n
	}
	return nil
}

func (cl *Client) chunked(p []byte, off int64, f func([]byte, int64) error) (int, error) {
	done := 0
	step := cl.maxReq - cl.maxReq%int(cl.minBlock())
	for done < len(p) {
		n := min(len(p)-done, step)
		if err := f(p[done:done+n], off+int64(done)); err != nil {
			return done, err
		}
		done += n
	}
	return done, nil
}

// Close sends NBD_CMD_DISC on every connection and closes them.
func (cl *Client) Close() error {
	if cl.rt != nil {
		return cl.rt.Close()
	}
	var errs []error
	for _, c := range cl.conns {
		errs = append(errs, c.close(cl.handle.Add(1)))
	}
	return errors.Join(errs...)
}

func (cl *Client) do(req Request, payload, dst []byte) error {
	req.Handle = cl.handle.Add(1)
	if cl.rt != nil {
		return cl.rt.RoundTrip(req, payload, dst)
	}
	c := cl.conns[int(cl.next.Add(1)%uint64(len(cl.conns)))]
	return c.roundTrip(req, payload, dst)
}

type call struct {
	dst  []byte
	cmd  uint16
	done chan error
}

var callPool = sync.Pool{New: func() any { return &call{done: make(chan error, 1)} }}

// smallWrites are the buffers that put a small write and its header in
// one TLS record.
var smallWrites = sync.Pool{New: func() any { b := make([]byte, 0, tlsRecord); return &b }}

type clientConn struct {
	conn net.Conn
	r    *bufio.Reader
	tls  bool // conn is TLS

	wmu sync.Mutex

	mu      sync.Mutex
	pending map[uint64]*call
	err     error
}

func (c *clientConn) roundTrip(req Request, payload, dst []byte) error {
	cl := callPool.Get().(*call)
	cl.dst, cl.cmd = dst, req.Type
	c.mu.Lock()
	if c.err != nil {
		err := c.err
		c.mu.Unlock()
		callPool.Put(cl)
		return err
	}
	c.pending[req.Handle] = cl
	c.mu.Unlock()

	var hdr [requestHeaderSize]byte
	req.Encode(hdr[:])
	c.wmu.Lock()
	var err error
	switch {
	case len(payload) > 0 && len(payload) <= tlsRecord-requestHeaderSize && c.tls:
		// One TLS record for a small write, not one for its header and
		// one for its payload.
		b := smallWrites.Get().(*[]byte)
		*b = append(append((*b)[:0], hdr[:]...), payload...)
		_, err = c.conn.Write(*b)
		smallWrites.Put(b)
	case len(payload) > 0 && c.tls:
		// The header's record and the payload's in as few system calls
		// as the transport's batch allows.
		err = Batched(c.conn, func() error {
			if _, err := c.conn.Write(hdr[:]); err != nil {
				return err
			}
			_, err := c.conn.Write(payload)
			return err
		})
	case len(payload) > 0:
		bufs := net.Buffers{hdr[:], payload}
		_, err = bufs.WriteTo(c.conn)
	default:
		_, err = c.conn.Write(hdr[:])
	}
	c.wmu.Unlock()
	if err != nil {
		c.fail(fmt.Errorf("%w: %v", ErrClosed, err))
	}
	err = <-cl.done
	cl.dst = nil
	callPool.Put(cl)
	return err
}

func (c *clientConn) readLoop() {
	var hdr [replyHeaderSize]byte
	for {
		if _, err := io.ReadFull(c.r, hdr[:]); err != nil {
			c.fail(fmt.Errorf("%w: %v", ErrClosed, err))
			return
		}
		rep, err := DecodeReply(hdr[:])
		if err != nil {
			c.fail(err)
			return
		}
		c.mu.Lock()
		cl, ok := c.pending[rep.Handle]
		delete(c.pending, rep.Handle)
		c.mu.Unlock()
		if !ok {
			c.fail(fmt.Errorf("%w: reply for unknown handle %#x", ErrProtocol, rep.Handle))
			return
		}
		if rep.Errno != 0 {
			cl.done <- &Error{Cmd: cl.cmd, Errno: rep.Errno}
			continue
		}
		if cl.cmd == CmdRead {
			if _, err := io.ReadFull(c.r, cl.dst); err != nil {
				err = fmt.Errorf("%w: reading payload: %v", ErrClosed, err)
				cl.done <- err
				c.fail(err)
				return
			}
		}
		cl.done <- nil
	}
}

// fail ends the connection: every pending and future request gets err.
func (c *clientConn) fail(err error) {
	c.mu.Lock()
	if c.err == nil {
		c.err = err
	}
	pend := c.pending
	c.pending = make(map[uint64]*call)
	c.mu.Unlock()
	c.conn.Close()
	for _, cl := range pend {
		cl.done <- c.err
	}
}

func (c *clientConn) close(handle uint64) error {
	c.mu.Lock()
	dead := c.err != nil
	c.mu.Unlock()
	var err error
	if !dead {
		var hdr [requestHeaderSize]byte
		(&Request{Type: CmdDisc, Handle: handle}).Encode(hdr[:])
		c.wmu.Lock()
		_, err = c.conn.Write(hdr[:])
		c.wmu.Unlock()
	}
	c.fail(ErrClosed)
	if errors.Is(err, net.ErrClosed) {
		err = nil
	}
	return err
}
