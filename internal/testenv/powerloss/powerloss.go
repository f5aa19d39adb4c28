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

// Package powerloss is a storage node that loses power, for tests of what
// a client keeps of the writes it was told are written: an NBD server on
// loopback whose backend holds written blocks in a cache until a FLUSH,
// and which comes back on the same address as a new incarnation holding
// only what was flushed.
package powerloss

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"io"
	"log/slog"
	"net"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/mpnbd/mpnbd/pkg/nbd"
)

// Export is the name of the one export.
const Export = "powerloss"

const block = 4096

// backend keeps writes in a cache; Sync copies them to the durable
// medium; a power loss drops the cache.
type backend struct {
	mu      sync.Mutex
	durable []byte
	cache   []byte
	dirty   map[int64]struct{}
	dead    bool
	// failSync makes the next Sync fail and lose the cache, as a
	// writeback error does (reported to one sync only).
	failSync bool
}

func (b *backend) ReadAt(p []byte, off int64) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return copy(p, b.cache[off:]), nil
}

func (b *backend) WriteAt(p []byte, off int64) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.dead {
		return len(p), nil
	}
	for blk := off / block; blk*block < off+int64(len(p)); blk++ {
		b.dirty[blk] = struct{}{}
	}
	return copy(b.cache[off:], p), nil
}

func (b *backend) Size() int64 { return int64(len(b.cache)) }

func (b *backend) Sync() error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.dead {
		// A node that lost power acknowledges no FLUSH: the reply of
		// a sync caught between the cut and the reset of its
		// connections must not say its writes are durable.
		return errors.New("powerloss: the node lost power")
	}
	if b.failSync {
		b.failSync = false
		copy(b.cache, b.durable)
		clear(b.dirty)
		return errors.New("powerloss: writeback failed")
	}
	for blk := range b.dirty {
		o := blk * block
		copy(b.durable[o:o+block], b.cache[o:o+block])
	}
	clear(b.dirty)
	return nil
}

func (b *backend) Trim(off, n int64) error { return b.Zero(off, n, false) }
func (b *backend) Zero(off, n int64, _ bool) error {
	_, err := b.WriteAt(make([]byte, n), off)
	return err
}
func (b *backend) Resize(int64) error { return errors.New("powerloss: no resize") }
func (b *backend) Close() error       { return nil }

// Node is the storage node.
type Node struct {
	t  testing.TB
	be *backend
	// Addr is where it listens, whether up or down.
	Addr string

	refused atomic.Int64

	mu    sync.Mutex
	srv   *nbd.Server
	ln    net.Listener
	conns []net.Conn
	done  chan struct{}
}

// Start runs a node with an export of size bytes; the test's end stops it.
func Start(t testing.TB, size int64) *Node {
	t.Helper()
	n := &Node{t: t, be: &backend{durable: make([]byte, size), cache: make([]byte, size), dirty: map[int64]struct{}{}}}
	n.up()
	t.Cleanup(n.stop)
	return n
}

func (n *Node) listen() net.Listener {
	addr := n.Addr
	if addr == "" {
		addr = "127.0.0.1:0"
	}
	var ln net.Listener
	var err error
	for range 100 {
		ln, err = net.Listen("tcp", addr)
		if !errors.Is(err, syscall.EADDRINUSE) {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	if err != nil {
		n.t.Fatalf("powerloss: listen %s: %v", addr, err)
	}
	n.Addr = ln.Addr().String()
	return ln
}

// up boots the server as a new incarnation.
func (n *Node) up() {
	var inc nbd.Incarnation
	_, _ = rand.Read(inc[:])
	srv := &nbd.Server{Logger: slog.New(slog.NewTextHandler(io.Discard, nil)), Incarnation: inc}
	if err := srv.AddExport(&nbd.Export{Name: Export, Backend: n.be}); err != nil {
		n.t.Fatal(err)
	}
	ln := n.listen()
	done := make(chan struct{})
	n.mu.Lock()
	n.srv, n.ln, n.conns, n.done = srv, ln, nil, done
	n.mu.Unlock()
	go func() {
		defer close(done)
		_ = srv.Serve(&tracking{Listener: ln, n: n})
	}()
}

type tracking struct {
	net.Listener
	n *Node
}

func (l *tracking) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err == nil {
		l.n.mu.Lock()
		l.n.conns = append(l.n.conns, c)
		l.n.mu.Unlock()
	}
	return c, err
}

// stop ends the server: listener closed, connections reset, handlers
// done.
func (n *Node) stop() {
	n.mu.Lock()
	srv, ln, conns, done := n.srv, n.ln, n.conns, n.done
	n.srv, n.ln, n.conns = nil, nil, nil
	n.mu.Unlock()
	if ln != nil {
		ln.Close()
	}
	for _, c := range conns {
		if tc, ok := c.(*net.TCPConn); ok {
			_ = tc.SetLinger(0)
		}
		c.Close()
	}
	if srv != nil {
		ctx, cancel := context.WithCancel(context.Background())
		cancel()
		_ = srv.Shutdown(ctx)
		<-done
	}
}

// PowerLoss cuts the node off (its connections reset, nothing answered
// any more), drops its cache, and leaves it booting: connections to Addr
// are accepted and closed at once (counted: Refused) until Restore.
func (n *Node) PowerLoss() {
	n.mu.Lock()
	ln := n.ln
	n.mu.Unlock()
	// No new connection reaches the server from here on.
	if ln != nil {
		ln.Close()
	}
	n.be.mu.Lock()
	n.be.dead = true
	copy(n.be.cache, n.be.durable)
	clear(n.be.dirty)
	n.be.mu.Unlock()
	n.stop()
	n.be.mu.Lock()
	n.be.dead = false
	n.be.mu.Unlock()
	booting := n.listen()
	done := make(chan struct{})
	n.mu.Lock()
	n.ln, n.done = booting, done
	n.mu.Unlock()
	go func() {
		defer close(done)
		for {
			c, err := booting.Accept()
			if err != nil {
				return
			}
			n.refused.Add(1)
			c.Close()
		}
	}()
}

// FailNextSync makes the node's next sync fail as a writeback error
// does: reported to that sync only, the cached writes lost.
func (n *Node) FailNextSync() {
	n.be.mu.Lock()
	n.be.failSync = true
	n.be.mu.Unlock()
}

// Refused counts the connections made while the node was booting.
func (n *Node) Refused() int { return int(n.refused.Load()) }

// Restore ends the boot: the server serves again, a new incarnation.
func (n *Node) Restore() {
	n.mu.Lock()
	ln, done := n.ln, n.done
	n.ln = nil
	n.mu.Unlock()
	ln.Close()
	<-done
	n.up()
}

// Durable returns n bytes at off of what the node's medium holds.
func (n *Node) Durable(off, length int64) []byte {
	n.be.mu.Lock()
	defer n.be.mu.Unlock()
	return bytes.Clone(n.be.durable[off : off+length])
}
