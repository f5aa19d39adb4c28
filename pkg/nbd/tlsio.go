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
	"crypto/tls"
	"net"
	"slices"
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

// tls12Suites are the TLS 1.2 cipher suites this package agrees to: ECDHE
// key exchange, so that a stolen key does not open recorded traffic, with
// an AEAD. CBC suites (padding oracles, Lucky Thirteen) and RSA key
// exchange (no forward secrecy) are left out. TLS 1.3's suites all have
// both properties and are not configurable.
var tls12Suites = []uint16{
	tls.TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256,
	tls.TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384,
	tls.TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256,
	tls.TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256,
	tls.TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384,
	tls.TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256,
}

// tlsConfig is c as this package runs it, on both sides: TLS 1.2 at least
// (the NBD protocol requires TLS implementations to accept 1.2; a caller
// may raise the floor to 1.3), only tls12Suites under 1.2 (those of
// c.CipherSuites, when set), and full-sized records.
func tlsConfig(c *tls.Config) *tls.Config {
	if c.MinVersion >= tls.VersionTLS12 && c.DynamicRecordSizingDisabled && c.CipherSuites != nil &&
		!slices.ContainsFunc(c.CipherSuites, func(id uint16) bool { return !slices.Contains(tls12Suites, id) }) {
		return c
	}
	c = c.Clone()
	c.MinVersion = max(c.MinVersion, tls.VersionTLS12)
	if c.CipherSuites == nil {
		c.CipherSuites = tls12Suites
	} else {
		// Left empty, no 1.2 handshake succeeds: 1.3 still does.
		c.CipherSuites = slices.DeleteFunc(slices.Clone(c.CipherSuites), func(id uint16) bool {
			return !slices.Contains(tls12Suites, id)
		})
	}
	// A connection carries bulk data from its first request: full
	// records from the start, not the small ones that speed up the
	// first bytes of a web page at the cost of more records to seal.
	// Both versions size records alike.
	c.DynamicRecordSizingDisabled = true
	return c
}

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
