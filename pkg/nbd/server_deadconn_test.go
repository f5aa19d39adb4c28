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
	"bytes"
	"context"
	"net"
	"sync"
	"testing"
	"time"
)

// writeGate blocks writes at offset 0 until released.
type writeGate struct {
	*MemBackend
	started chan struct{}
	gate    chan struct{}
}

func (g *writeGate) WriteAt(p []byte, off int64) (int, error) {
	if off == 0 {
		close(g.started)
		<-g.gate
	}
	return g.MemBackend.WriteAt(p, off)
}

// readEndConn reports when a Read of the server's end fails: the server
// has seen the connection end.
type readEndConn struct {
	net.Conn
	once  sync.Once
	ended chan struct{}
}

func (c *readEndConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	if err != nil {
		c.once.Do(func() { close(c.ended) })
	}
	return n, err
}

// TestQueuedRequestsOfAClosedConnectionAreDropped: a connection ends
// (its client gave up on it: the kernel shut a timed-out socket down, a
// path died) while a request it sent is executing and a later one waits
// in the queue. The one executing completes; the one waiting must never
// run: the client requeues it on another connection, where newer writes
// to the same blocks may follow, and a late execution would overwrite
// them. A connection without a session has no successor to fence it, so
// its own end has to.
func TestQueuedRequestsOfAClosedConnectionAreDropped(t *testing.T) {
	g := &writeGate{MemBackend: NewMemBackend(1 << 20), started: make(chan struct{}), gate: make(chan struct{})}
	s := newTestServer(t, &Export{Name: "vol", Backend: g})
	s.Workers = 1
	s.NoInline = true
	c1, c2 := net.Pipe()
	srvEnd := &readEndConn{Conn: c2, ended: make(chan struct{})}
	served := make(chan struct{})
	go func() {
		defer close(served)
		s.ServeConn(srvEnd)
	}()
	defer c1.Close()
	if _, err := NegotiateConn(context.Background(), c1, "vol"); err != nil {
		t.Fatal(err)
	}
	first := bytes.Repeat([]byte{1}, 4096)
	late := bytes.Repeat([]byte{2}, 4096)
	sendReq(t, c1, Request{Type: CmdWrite, Handle: 1, Offset: 0, Length: 4096}, first)
	select {
	case <-g.started:
	case <-time.After(5 * time.Second):
		t.Fatal("the first write never started")
	}
	sendReq(t, c1, Request{Type: CmdWrite, Handle: 2, Offset: 8192, Length: 4096}, late)
	// The second write is read and queued behind the first (one worker).
	waitQueued(t, s, 2)
	c1.Close()
	select {
	case <-srvEnd.ended:
	case <-time.After(5 * time.Second):
		t.Fatal("the server did not see the connection end")
	}
	close(g.gate)
	select {
	case <-served:
	case <-time.After(5 * time.Second):
		t.Fatal("the connection's handler did not end")
	}
	got := make([]byte, 4096)
	if _, err := g.ReadAt(got, 0); err != nil || !bytes.Equal(got, first) {
		t.Fatalf("the write already executing when the connection ended was not completed (%v)", err)
	}
	if _, err := g.ReadAt(got, 8192); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, make([]byte, 4096)) {
		t.Fatal("a write still queued when its connection ended was executed after the end: a late write the client had given up on")
	}
}

// waitQueued waits until the server's one connection holds n requests.
func waitQueued(t *testing.T, s *Server, n int) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		s.mu.Lock()
		held := 0
		for sc := range s.conns {
			if sc.lim != nil {
				sc.lim.mu.Lock()
				held += sc.lim.reqs
				sc.lim.mu.Unlock()
			}
		}
		s.mu.Unlock()
		if held >= n {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("the server holds %d requests, want %d", held, n)
		}
		time.Sleep(5 * time.Millisecond)
	}
}
