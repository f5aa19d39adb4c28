package nbd

import (
	"bufio"
	"crypto/tls"
	"net"
	"sync"
)

// tlsIOSize is the read buffer and the write batch of a TLS connection's
// transport: 16 records.
const tlsIOSize = 16 * (tlsRecord + 256)

// tlsTransport is what a TLS connection of this package runs on, the
// socket with buffers on both sides. crypto/tls reads and writes its
// socket a record at a time: at most 16 KiB per system call, where a
// plaintext connection moves a megabyte in one. Reads go through a buffer
// that takes whatever the socket holds; writes made inside Batched are
// gathered and go out together when it ends.
type tlsTransport struct {
	net.Conn
	r *bufio.Reader

	mu       sync.Mutex
	batching bool
	buf      []byte
}

func newTLSTransport(c net.Conn) *tlsTransport {
	return &tlsTransport{Conn: c, r: bufio.NewReaderSize(c, tlsIOSize)}
}

func (t *tlsTransport) Read(p []byte) (int, error) { return t.r.Read(p) }

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
