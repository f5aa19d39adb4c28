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
	"io"
	"net"
	"sync"
	"testing"
	"time"
)

// blockedWrites blocks every write until its gate closes.
type blockedWrites struct {
	*MemBackend
	gate chan struct{}
}

func (g *blockedWrites) WriteAt(p []byte, off int64) (int, error) {
	<-g.gate
	return g.MemBackend.WriteAt(p, off)
}

// heldBytes is what the requests in flight of the export's connections
// hold together, as its budgets count it.
func heldBytes(s *Server, e *Export) int {
	n := 0
	e.mu.Lock()
	if e.mem != nil {
		n = e.mem.held()
	}
	e.mu.Unlock()
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, b := range s.srcMem {
		n = max(n, b.held())
	}
	return n
}

// dialFrom connects to the server's listener from a given loopback source
// address and negotiates export d.
func dialFrom(t *testing.T, addr, src string) net.Conn {
	t.Helper()
	d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(src)}}
	c, err := d.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	if _, err := NegotiateConn(context.Background(), c, "d"); err != nil {
		t.Fatal(err)
	}
	return c
}

// TestInflightBudgetsSharedByConnections: several connections, each well
// within its own bound, together hold no more than the budget of their
// source (or of their export); and once the backend moves again, every
// request completes.
func TestInflightBudgetsSharedByConnections(t *testing.T) {
	const (
		write  = 256 << 10
		perReq = write + reqOverhead
		budget = 1 << 20
	)
	for _, tc := range []struct {
		name    string
		sources []string
		set     func(s *Server)
	}{
		{"per source", []string{"127.0.0.1", "127.0.0.1", "127.0.0.1"}, func(s *Server) {
			s.MaxInflightBytesPerSource, s.MaxInflightBytesPerExport = budget, -1
		}},
		{"per export", []string{"127.0.0.1", "127.0.0.2", "127.0.0.3"}, func(s *Server) {
			s.MaxInflightBytesPerSource, s.MaxInflightBytesPerExport = -1, budget
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g := &blockedWrites{MemBackend: NewMemBackend(16 << 20), gate: make(chan struct{})}
			open := sync.OnceFunc(func() { close(g.gate) })
			e := &Export{Name: "d", Backend: g}
			s := newTestServer(t, e)
			t.Cleanup(open) // before the server's shutdown, which waits for the writes
			s.MaxInflightBytes = 4 << 20
			s.NoInline = true // the reader must not block in the backend itself
			tc.set(s)
			l, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { l.Close() })
			go s.Serve(l)
			const perConn = 8
			var conns []net.Conn
			for i, src := range tc.sources {
				c := dialFrom(t, l.Addr().String(), src)
				conns = append(conns, c)
				go func() {
					for j := 0; j < perConn; j++ {
						b := make([]byte, requestHeaderSize+write)
						(&Request{Type: CmdWrite, Handle: uint64(j), Offset: uint64((i*perConn + j) * write), Length: write}).Encode(b)
						if _, err := c.Write(b); err != nil {
							return
						}
					}
				}()
			}
			// Wait until the server holds what it will hold.
			held, since := -1, time.Now()
			deadline := time.Now().Add(10 * time.Second)
			for time.Since(since) < 300*time.Millisecond {
				if time.Now().After(deadline) {
					t.Fatalf("what the server holds never settled (%d bytes)", held)
				}
				if n := heldBytes(s, e); n != held {
					held, since = n, time.Now()
				}
				time.Sleep(10 * time.Millisecond)
			}
			if held > budget {
				t.Fatalf("%d connections hold %d bytes in flight together, with a budget of %d", len(conns), held, budget)
			}
			if held < budget-perReq {
				t.Fatalf("the connections hold only %d bytes: the budget of %d is not used", held, budget)
			}
			open()
			for _, c := range conns {
				c.SetReadDeadline(time.Now().Add(10 * time.Second))
				for j := 0; j < perConn; j++ {
					var rb [replyHeaderSize]byte
					if _, err := io.ReadFull(c, rb[:]); err != nil {
						t.Fatalf("reply %d: %v", j, err)
					}
					if r, err := DecodeReply(rb[:]); err != nil || r.Errno != 0 {
						t.Fatalf("reply %d: %+v %v", j, r, err)
					}
				}
			}
		})
	}
}
