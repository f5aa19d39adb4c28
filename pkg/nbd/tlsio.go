package nbd

import (
	"bufio"
	"crypto/tls"
	"net"
	"sync"
	"sync/atomic"
)

// tlsIOSize is the read buffer and the write batch of a TLS connection's
// transport: 16 records.
const tlsIOSize = 16 * (tlsRecord + 256)

// serverTLSBuffers counts the server connections given TLS transport
// buffers, for tests.
var serverTLSBuffers atomic.Int64

// tlsTransport is what a TLS connection of this package runs on, the
// socket with buffers on both sides. crypto/tls reads and writes its
// socket a record at a time: at most 16 KiB per system call, where a
// plaintext connection moves a megabyte in one. Reads go through a buffer
// that takes whatever the socket holds; writes made inside Batched are
// gathered and go out together when it ends.
//
// The read buffer is a quarter megabyte, so a transport starts without
// it and reads the socket directly: the server gives it one (buffer) only
// to a client that is verified and chose an export, so that STARTTLS
// handshakes of clients it refuses cost it no more than plaintext ones
// (crypto/tls keeps what it read ahead itself, so nothing is lost when
// the buffer comes).
type tlsTransport struct {
	net.Conn
	r *bufio.Reader

	mu       sync.Mutex
	batching bool
	buf      []byte
}

func newTLSTransport(c net.Conn) *tlsTransport {
	return &tlsTransport{Conn: c}
}

// buffer gives t its read buffer. Reads of t must not run meanwhile: call
// it from the goroutine that reads, between two reads.
func (t *tlsTransport) buffer() {
	if t.r == nil {
		t.r = bufio.NewReaderSize(t.Conn, tlsIOSize)
	}
}

func (t *tlsTransport) Read(p []byte) (int, error) {
	if t.r == nil {
		return t.Conn.Read(p)
	}
	return t.r.Read(p)
}

// Write sends p at once, or, inside Batched, adds it to the batch (which
// goes out first when p does not fit).
func (t *tlsTransport) Write(p []byte) (int, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if !t.batching {
		return t.Conn.Write(p)
	}
	if len(t.buf)+len(p) > cap(t.buf) {
		if err := t.flushLocked(); err != nil {
			return 0, err
		}
		if len(p) > cap(t.buf) {
			return t.Conn.Write(p)
		}
	}
	t.buf = append(t.buf, p...)
	return len(p), nil
}

func (t *tlsTransport) flushLocked() error {
	if len(t.buf) == 0 {
		return nil
	}
	_, err := t.Conn.Write(t.buf)
	t.buf = t.buf[:0]
	return err
}

// NetConn is the socket (for MPTCP and socket options).
func (t *tlsTransport) NetConn() net.Conn { return t.Conn }

// tlsOver makes the TLS connection of cfg's side over c, on a transport
// that Batched can gather.
func tlsOver(c net.Conn, cfg *tls.Config, server bool) *tls.Conn {
	t := newTLSTransport(c)
	if server {
		return tls.Server(t, tlsConfig(cfg))
	}
	return tls.Client(t, tlsConfig(cfg))
}

// bufferTLS gives c's transport its read buffer when c is a TLS
// connection of this package that has none yet; it reports whether it
// did. See tlsTransport for when.
func bufferTLS(c net.Conn) bool {
	tc, ok := c.(*tls.Conn)
	if !ok {
		return false
	}
	t, ok := tc.NetConn().(*tlsTransport)
	if !ok || t.r != nil {
		return false
	}
	t.buffer()
	return true
}

// Batched runs write, which writes to c, with what it writes gathered into
// as few system calls as the transport's batch allows when c is a TLS
// connection of this package (one made by Dial, NegotiateConnTLS or the
// Server); for any other connection it runs write alone. Use it around a
// burst of writes: a request or reply with its payload, or several.
func Batched(c net.Conn, write func() error) error {
	tc, ok := c.(*tls.Conn)
	if !ok {
		return write()
	}
	t, ok := tc.NetConn().(*tlsTransport)
	if !ok || !tc.ConnectionState().HandshakeComplete {
		// A handshake must not wait in the batch for its own answer.
		return write()
	}
	t.mu.Lock()
	t.batching = true
	if t.buf == nil {
		t.buf = make([]byte, 0, tlsIOSize)
	}
	t.mu.Unlock()
	err := write()
	t.mu.Lock()
	t.batching = false
	if ferr := t.flushLocked(); err == nil {
		err = ferr
	}
	t.mu.Unlock()
	return err
}
