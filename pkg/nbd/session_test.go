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
	"testing"
	"time"
)

// stallBackend blocks writes at offset 0 until gate is closed and reports
// when one has started.
type stallBackend struct {
	*MemBackend
	gate    chan struct{}
	started chan struct{}
}

func (b *stallBackend) WriteAt(p []byte, off int64) (int, error) {
	if off == 0 {
		select {
		case b.started <- struct{}{}:
		default:
		}
		<-b.gate
	}
	return b.MemBackend.WriteAt(p, off)
}

// tcpConn returns a loopback TCP connection that s serves: unlike a pipe
// it buffers, so a client can send while the server is not reading.
func tcpConn(t *testing.T, s *Server) net.Conn {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go s.Serve(l)
	t.Cleanup(func() { l.Close() })
	c, err := net.Dial("tcp", l.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	c.SetWriteDeadline(time.Now().Add(10 * time.Second))
	t.Cleanup(func() { c.Close() })
	return c
}

// sessionConn negotiates a raw connection as lane 0 of session id.
func sessionConn(t *testing.T, s *Server, id SessionID, gen uint64) (net.Conn, ExportInfo) {
	t.Helper()
	c := tcpConn(t, s)
	info, err := NegotiateConnWith(context.Background(), c, "d", NegotiateOptions{Session: &Session{ID: id, Generation: gen}})
	if err != nil {
		t.Fatalf("negotiate: %v", err)
	}
	return c, info
}

// TestSessionFencesSupersededConnection is the stale-write case: a write
// stalls in the backend on connection 1 with another queued behind it;
// the client gives up on that connection without NBD_CMD_DISC and writes
// newer data on connection 2 of the same session. Nothing of connection 1
// may land after connection 2's writes: the newer data always survives.
// Without a session (the kernel's multiconn sockets) nothing fences
// connection 1 but its own end, which drops what it had not started.
func TestSessionFencesSupersededConnection(t *testing.T) {
	for _, fenced := range []bool{true, false} {
		name := "fenced"
		if !fenced {
			name = "no session (the end of connection 1 drops its queue)"
		}
		t.Run(name, func(t *testing.T) {
			const blk = 4096
			be := &stallBackend{MemBackend: NewMemBackend(1 << 20), gate: make(chan struct{}), started: make(chan struct{}, 1)}
			// Without a session, requests go to the worker: a write run
			// by the reader itself (inline) holds it, and the request
			// behind it is not read, nor the connection's end, until
			// that write ends; only a session fences that one.
			s := &Server{Logger: quietLogger(), Workers: 1, NoInline: !fenced}
			if err := s.AddExport(&Export{Name: "d", Backend: be}); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() {
				ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
				defer cancel()
				s.Shutdown(ctx)
			})
			id := NewSessionID()
			dial := func() net.Conn {
				if !fenced {
					c := tcpConn(t, s)
					if _, err := NegotiateConn(context.Background(), c, "d"); err != nil {
						t.Fatal(err)
					}
					return c
				}
				c, info := sessionConn(t, s, id, NextGeneration())
				if !info.Fenced || info.Incarnation == (Incarnation{}) {
					t.Fatalf("session not taken: %+v", info)
				}
				return c
			}
			old := bytes.Repeat([]byte{0xa1}, blk)
			stale := bytes.Repeat([]byte{0xa2}, blk)
			newer := bytes.Repeat([]byte{0xb2}, blk)

			c1 := dial()
			sendReq(t, c1, Request{Type: CmdWrite, Handle: 1, Offset: 0, Length: blk}, old)
			sendReq(t, c1, Request{Type: CmdWrite, Handle: 2, Offset: blk, Length: blk}, stale)
			select {
			case <-be.started:
			case <-time.After(5 * time.Second):
				t.Fatal("the first write never reached the backend")
			}
			// Request 2 is read and queued behind the stalled one (one
			// worker). Give the reader a moment to take it off the wire.
			time.Sleep(50 * time.Millisecond)
			c1.Close()
			if !fenced {
				// Nothing tells the server that connection 2 follows
				// connection 1 but connection 1's end, which it must
				// have read (a loaded machine can delay its reader past
				// connection 2's write).
				waitReadEnded(t, s)
			}

			c2 := dial()
			sendReq(t, c2, Request{Type: CmdWrite, Handle: 3, Offset: blk, Length: blk}, newer)
			if fenced {
				// Connection 2 must wait for connection 1's write in the
				// backend before it executes anything.
				c2.SetReadDeadline(time.Now().Add(200 * time.Millisecond))
				var b [1]byte
				if n, _ := c2.Read(b[:]); n != 0 {
					t.Fatal("connection 2 answered while connection 1 still had a write executing")
				}
				c2.SetReadDeadline(time.Time{})
			} else {
				if r := readRep(t, c2); r.Errno != 0 {
					t.Fatalf("write: %+v", r)
				}
			}
			close(be.gate)
			if fenced {
				if r := readRep(t, c2); r.Handle != 3 || r.Errno != 0 {
					t.Fatalf("write on connection 2: %+v", r)
				}
			}
			sendReq(t, c2, Request{Type: CmdFlush, Handle: 4}, nil)
			if r := readRep(t, c2); r.Handle != 4 || r.Errno != 0 {
				t.Fatalf("flush: %+v", r)
			}
			// A stale write would run after the newer one once the gate
			// opens; give it the time to.
			at := func() []byte {
				b := make([]byte, blk)
				if _, err := be.ReadAt(b, blk); err != nil {
					t.Fatal(err)
				}
				return b
			}
			deadline := time.Now().Add(2 * time.Second)
			for !fenced && time.Now().Before(deadline) && bytes.Equal(at(), newer) {
				time.Sleep(10 * time.Millisecond)
			}
			if !bytes.Equal(at(), newer) {
				t.Fatal("a write of the superseded connection overwrote the newer data")
			}
		})
	}
}

// TestSessionRefusesOlderGeneration: a connection that arrives late, with
// a generation below the current one of its lane, is not served.
func TestSessionRefusesOlderGeneration(t *testing.T) {
	s := newTestServer(t, &Export{Name: "d", Backend: NewMemBackend(1 << 20)})
	id := NewSessionID()
	newer, _ := sessionConn(t, s, id, 200)
	sendReq(t, newer, Request{Type: CmdFlush, Handle: 1}, nil)
	if r := readRep(t, newer); r.Errno != 0 {
		t.Fatalf("flush: %+v", r)
	}
	late, _ := sessionConn(t, s, id, 100)
	sendReq(t, late, Request{Type: CmdFlush, Handle: 2}, nil)
	late.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := late.Read(make([]byte, 1)); err == nil {
		t.Fatal("a connection older than its lane's current one was served")
	}
	// The current connection is untouched; another lane is independent.
	sendReq(t, newer, Request{Type: CmdFlush, Handle: 3}, nil)
	if r := readRep(t, newer); r.Handle != 3 || r.Errno != 0 {
		t.Fatalf("flush after the refusal: %+v", r)
	}
	c := tcpConn(t, s)
	if _, err := NegotiateConnWith(context.Background(), c, "d", NegotiateOptions{Session: &Session{ID: id, Lane: 1, Generation: 1}}); err != nil {
		t.Fatal(err)
	}
	sendReq(t, c, Request{Type: CmdFlush, Handle: 4}, nil)
	if r := readRep(t, c); r.Handle != 4 || r.Errno != 0 {
		t.Fatalf("flush on lane 1: %+v", r)
	}
}

// TestSessionIdleConnectionSupersedesNothing: a connection of the lane
// that sends no request (a client that dialed and dropped it unused, as a
// re-adopting node plugin does when the kernel's socket is healthy) leaves
// the active one serving; the next connection that does send supersedes
// the active one, and the idle one, older than it, is then refused.
func TestSessionIdleConnectionSupersedesNothing(t *testing.T) {
	s := newTestServer(t, &Export{Name: "d", Backend: NewMemBackend(1 << 20)})
	id := NewSessionID()
	flush := func(c net.Conn, h uint64) Reply {
		t.Helper()
		sendReq(t, c, Request{Type: CmdFlush, Handle: h}, nil)
		return readRep(t, c)
	}
	c1, _ := sessionConn(t, s, id, 100)
	if r := flush(c1, 1); r.Errno != 0 {
		t.Fatalf("flush on the first connection: %+v", r)
	}
	idle, _ := sessionConn(t, s, id, 200)
	if r := flush(c1, 2); r.Handle != 2 || r.Errno != 0 {
		t.Fatalf("the active connection after an idle one joined: %+v", r)
	}
	idle.Close()
	if r := flush(c1, 3); r.Handle != 3 || r.Errno != 0 {
		t.Fatalf("the active connection after the idle one left: %+v", r)
	}
	late, _ := sessionConn(t, s, id, 300)
	newest, _ := sessionConn(t, s, id, 400)
	if r := flush(newest, 4); r.Handle != 4 || r.Errno != 0 {
		t.Fatalf("flush on the newest connection: %+v", r)
	}
	for name, c := range map[string]net.Conn{"the superseded connection": c1, "a connection older than the newest": late} {
		sendReq(t, c, Request{Type: CmdFlush, Handle: 5}, nil)
		c.SetReadDeadline(time.Now().Add(5 * time.Second))
		if _, err := c.Read(make([]byte, 1)); err == nil {
			t.Fatalf("%s was served", name)
		}
	}
}

// TestSessionIncarnation: the incarnation is the server's, the same for
// every connection, and a server told its own announces that.
func TestSessionIncarnation(t *testing.T) {
	s := newTestServer(t, &Export{Name: "d", Backend: NewMemBackend(4096)})
	_, a := sessionConn(t, s, NewSessionID(), 1)
	_, b := sessionConn(t, s, NewSessionID(), 1)
	if a.Incarnation != b.Incarnation || a.Incarnation != processIncarnation() {
		t.Fatalf("incarnations %v, %v; process %v", a.Incarnation, b.Incarnation, processIncarnation())
	}
	s2 := newTestServer(t, &Export{Name: "d", Backend: NewMemBackend(4096)})
	s2.Incarnation = Incarnation{1, 2, 3}
	if _, c := sessionConn(t, s2, NewSessionID(), 1); c.Incarnation != s2.Incarnation {
		t.Fatalf("incarnation %v, want %v", c.Incarnation, s2.Incarnation)
	}
}

// TestSessionOptionMalformed: a session option of the wrong length is
// refused with ERR_INVALID and the handshake goes on.
func TestSessionOptionMalformed(t *testing.T) {
	s := newTestServer(t, &Export{Name: "d", Backend: NewMemBackend(4096)})
	c := pipeConn(t, s)
	if _, err := clientHello(c); err != nil {
		t.Fatal(err)
	}
	o := option{Code: OptSession, Data: []byte{1, 2, 3}}
	if _, err := c.Write(o.encode()); err != nil {
		t.Fatal(err)
	}
	if r, err := readOptReply(c); err != nil || r.Type != RepErrInvalid {
		t.Fatalf("reply %+v, %v", r, err)
	}
	o = option{Code: OptAbort}
	if _, err := c.Write(o.encode()); err != nil {
		t.Fatal(err)
	}
	if r, err := readOptReply(c); err != nil || r.Type != RepAck {
		t.Fatalf("abort: %+v %v", r, err)
	}
}

// TestSessionWithoutServerSupport: against a server that answers the
// option with ERR_UNSUP the handshake succeeds, unfenced.
func TestSessionWithoutServerSupport(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	go func() {
		if c, err := l.Accept(); err == nil {
			fakeUnsupServer(c)
		}
	}()
	c1, err := net.Dial("tcp", l.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c1.Close()
	info, err := NegotiateConnWith(context.Background(), c1, "d", NegotiateOptions{Session: &Session{ID: NewSessionID(), Generation: 1}})
	if err != nil {
		t.Fatal(err)
	}
	if info.Fenced || info.Incarnation != (Incarnation{}) || info.Size != 4096 {
		t.Fatalf("info %+v", info)
	}
}

// fakeUnsupServer speaks just enough of a server that knows no session
// option: greeting, ERR_UNSUP, then GO with an export of 4096 bytes.
func fakeUnsupServer(c net.Conn) {
	defer c.Close()
	var hello [18]byte
	be.PutUint64(hello[0:], magicNBD)
	be.PutUint64(hello[8:], magicIHaveOpt)
	be.PutUint16(hello[16:], flagFixedNewstyle|flagNoZeroes)
	// A write that fails ends the exchange: the client sees the end.
	if _, err := c.Write(hello[:]); err != nil {
		return
	}
	var cf [4]byte
	if _, err := c.Read(cf[:]); err != nil {
		return
	}
	for {
		o, err := readOption(c)
		if err != nil {
			return
		}
		switch o.Code {
		case OptGo:
			r := optReply{Option: OptGo, Type: RepInfo, Data: encodeInfoExport(4096, FlagHasFlags)}
			if _, err := c.Write(r.encode()); err != nil {
				return
			}
			r = optReply{Option: OptGo, Type: RepAck}
			_, _ = c.Write(r.encode())
			return
		default:
			r := optReply{Option: o.Code, Type: RepErrUnsup}
			if _, err := c.Write(r.encode()); err != nil {
				return
			}
		}
	}
}

func TestBootIncarnation(t *testing.T) {
	a, err := BootIncarnation()
	if err != nil {
		t.Skipf("skipping: no boot ID here: %v", err)
	}
	b, _ := BootIncarnation()
	if a != b || a == (Incarnation{}) || a == processIncarnation() {
		t.Fatalf("boot incarnations %v, %v (process %v)", a, b, processIncarnation())
	}
}

// waitReadEnded waits (bounded) until one of s's connections has read its
// end.
func waitReadEnded(t *testing.T, s *Server) {
	t.Helper()
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		ended := false
		s.mu.Lock()
		for _, e := range s.exports {
			e.mu.Lock()
			for c := range e.conns {
				ended = ended || c.gone.Load()
			}
			e.mu.Unlock()
		}
		s.mu.Unlock()
		if ended {
			return
		}
		if time.Now().After(deadline) {
			t.Fatal("the server did not read the end of connection 1 within 5 s")
		}
	}
}
