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
	"crypto/rand"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

func quietLogger() *slog.Logger {
	return slog.New(slog.NewTextHandler(io.Discard, nil))
}

func newTestServer(t *testing.T, exports ...*Export) *Server {
	t.Helper()
	s := &Server{Logger: quietLogger()}
	for _, e := range exports {
		if err := s.AddExport(e); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		s.Shutdown(ctx)
	})
	return s
}

// pipeConn returns the client end of a net.Pipe whose other end s serves.
func pipeConn(t *testing.T, s *Server) net.Conn {
	t.Helper()
	c1, c2 := net.Pipe()
	go s.ServeConn(c2)
	t.Cleanup(func() { c1.Close() })
	return c1
}

func dialPipe(t *testing.T, s *Server, export string, n int) *Client {
	t.Helper()
	var conns []net.Conn
	var info ExportInfo
	for i := 0; i < n; i++ {
		c := pipeConn(t, s)
		ci, err := NegotiateConn(context.Background(), c, export)
		if err != nil {
			t.Fatalf("negotiate: %v", err)
		}
		info = ci
		conns = append(conns, c)
	}
	cl := NewClient(info, conns, quietLogger())
	t.Cleanup(func() { cl.Close() })
	return cl
}

func randBytes(n int) []byte {
	b := make([]byte, n)
	rand.Read(b)
	return b
}

func TestClientServerRoundTrip(t *testing.T) {
	const size = 8 << 20
	mem := NewMemBackend(size)
	s := newTestServer(t, &Export{Name: "disk", Description: "test disk", Backend: mem})
	cl := dialPipe(t, s, "disk", 3)

	info := cl.Info()
	if info.Size != size || info.Description != "test disk" || info.PrefBlock != 4096 || info.MaxBlock != MaxRequestSize {
		t.Fatalf("info = %+v", info)
	}
	wantFlags := FlagHasFlags | FlagSendFlush | FlagSendFUA | FlagCanMultiConn | FlagSendTrim | FlagSendWriteZeroes
	if info.Flags != wantFlags {
		t.Fatalf("flags = %#x, want %#x", info.Flags, wantFlags)
	}

	// Many concurrent writers over three connections, then read everything back.
	want := randBytes(size)
	var wg sync.WaitGroup
	errs := make(chan error, 64)
	for i := 0; i < 64; i++ {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			chunk := size / 64
			off := int64(i * chunk)
			var flags uint16
			if i%7 == 0 {
				flags = CmdFlagFUA
			}
			if _, err := cl.WriteAtFlags(want[off:off+int64(chunk)], off, flags); err != nil {
				errs <- err
			}
		}(i)
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	if err := cl.Flush(); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, size)
	if _, err := cl.ReadAt(got, 0); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) {
		t.Fatal("read back differs from what was written")
	}
	if !bytes.Equal(mem.data, want) {
		t.Fatal("backend differs from what was written")
	}

	// Trim and write-zeroes read back as zeroes and leave neighbours alone.
	if err := cl.Trim(4096, 8192); err != nil {
		t.Fatal(err)
	}
	if err := cl.WriteZeroes(1<<20, 4096, true); err != nil {
		t.Fatal(err)
	}
	clear(want[4096 : 4096+8192])
	clear(want[1<<20 : 1<<20+4096])
	if _, err := cl.ReadAt(got, 0); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) {
		t.Fatal("trim/zero changed the wrong bytes")
	}
}

// syncCounter counts Sync calls of a backend.
type syncCounter struct {
	Backend
	syncs atomic.Int64
}

func (s *syncCounter) Sync() error { s.syncs.Add(1); return s.Backend.Sync() }

func TestFUAAndFlushSync(t *testing.T) {
	b := &syncCounter{Backend: NewMemBackend(1 << 20)}
	s := newTestServer(t, &Export{Name: "d", Backend: b})
	cl := dialPipe(t, s, "d", 1)
	if _, err := cl.WriteAt(make([]byte, 512), 0); err != nil {
		t.Fatal(err)
	}
	if n := b.syncs.Load(); n != 0 {
		t.Fatalf("plain write synced %d times", n)
	}
	if _, err := cl.WriteAtFlags(make([]byte, 512), 0, CmdFlagFUA); err != nil {
		t.Fatal(err)
	}
	if n := b.syncs.Load(); n != 1 {
		t.Fatalf("FUA write: %d syncs, want 1", n)
	}
	if err := cl.Flush(); err != nil {
		t.Fatal(err)
	}
	if n := b.syncs.Load(); n != 2 {
		t.Fatalf("flush: %d syncs, want 2", n)
	}
}

func TestNegotiationErrors(t *testing.T) {
	s := newTestServer(t,
		&Export{Name: "a", Backend: NewMemBackend(4096)},
		&Export{Name: "secret", Backend: NewMemBackend(4096)},
	)
	s.Authorize = func(c ConnInfo, name string) error {
		if name == "secret" {
			return errors.New("not published to this node")
		}
		return nil
	}
	if _, err := NegotiateConn(context.Background(), pipeConn(t, s), "missing"); !errors.Is(err, ErrUnknownExport) {
		t.Errorf("unknown export: %v", err)
	}
	if _, err := NegotiateConn(context.Background(), pipeConn(t, s), "secret"); !errors.Is(err, ErrAccessDenied) {
		t.Errorf("denied export: %v", err)
	}
	names, err := ListExports(pipeConn(t, s))
	if err != nil || len(names) != 1 || names[0] != "a" {
		t.Errorf("list = %v, %v (denied exports must not be listed)", names, err)
	}
	s.DisableList = true
	if _, err := ListExports(pipeConn(t, s)); !errors.Is(err, ErrAccessDenied) {
		t.Errorf("disabled list: %v", err)
	}
	s.DefaultExport = "a"
	info, err := NegotiateConn(context.Background(), pipeConn(t, s), "")
	if err != nil || info.Size != 4096 {
		t.Errorf("default export: %+v, %v", info, err)
	}
}

func TestExportNameOption(t *testing.T) {
	s := newTestServer(t, &Export{Name: "ro", Backend: NewMemBackend(8192), ReadOnly: true})
	c := pipeConn(t, s)
	noZeroes, err := clientHello(c)
	if err != nil || !noZeroes {
		t.Fatalf("hello: %v %v", noZeroes, err)
	}
	info, err := exportNameFallback(c, "ro", noZeroes)
	if err != nil || info.Size != 8192 || info.Flags&FlagReadOnly == 0 || info.Flags&FlagSendTrim != 0 {
		t.Fatalf("EXPORT_NAME: %+v, %v", info, err)
	}
	cl := NewClient(info, []net.Conn{c}, quietLogger())
	defer cl.Close()
	var nerr *Error
	if _, err := cl.WriteAt([]byte{1}, 0); !errors.As(err, &nerr) || nerr.Errno != EPERM {
		t.Fatalf("write to read-only export: %v", err)
	}
	if _, err := cl.ReadAt(make([]byte, 8192), 0); err != nil {
		t.Fatalf("read after refused write: %v", err)
	}
}

func TestUnsupportedOptions(t *testing.T) {
	s := newTestServer(t, &Export{Name: "d", Backend: NewMemBackend(4096)})
	c := pipeConn(t, s)
	if _, err := clientHello(c); err != nil {
		t.Fatal(err)
	}
	for _, code := range []uint32{OptStructuredReply, OptStartTLS, OptExtendedHeaders, 999} {
		o := option{Code: code}
		if _, err := c.Write(o.encode()); err != nil {
			t.Fatal(err)
		}
		r, err := readOptReply(c)
		if err != nil || r.Option != code || r.Type != RepErrUnsup {
			t.Errorf("option %s: reply %+v, %v", OptName(code), r, err)
		}
	}
	o := option{Code: OptAbort}
	if _, err := c.Write(o.encode()); err != nil {
		t.Fatal(err)
	}
	if r, err := readOptReply(c); err != nil || r.Type != RepAck {
		t.Errorf("abort: %+v %v", r, err)
	}
}

// rawSession negotiates on a raw connection so tests can send any bytes.
func rawSession(t *testing.T, s *Server, export string) net.Conn {
	t.Helper()
	c := pipeConn(t, s)
	if _, err := NegotiateConn(context.Background(), c, export); err != nil {
		t.Fatal(err)
	}
	return c
}

func sendReq(t *testing.T, c net.Conn, r Request, payload []byte) {
	t.Helper()
	b := make([]byte, requestHeaderSize+len(payload))
	r.Encode(b)
	copy(b[requestHeaderSize:], payload)
	if _, err := c.Write(b); err != nil {
		t.Fatalf("send %+v: %v", r, err)
	}
}

func readRep(t *testing.T, c net.Conn) Reply {
	t.Helper()
	var b [replyHeaderSize]byte
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := io.ReadFull(c, b[:]); err != nil {
		t.Fatalf("read reply: %v", err)
	}
	r, err := DecodeReply(b[:])
	if err != nil {
		t.Fatal(err)
	}
	return r
}

func TestBadRequests(t *testing.T) {
	const size = 1 << 20
	mem := NewMemBackend(size + 4096)
	// Keep a guard area beyond the export in the same array.
	if err := mem.Resize(size); err != nil {
		t.Fatal(err)
	}
	guard := mem.data[:size+4096][size:]
	for i := range guard {
		guard[i] = 0xaa
	}
	s := newTestServer(t, &Export{Name: "d", Backend: mem})
	c := rawSession(t, s, "d")

	cases := []struct {
		name    string
		req     Request
		payload []byte
		errno   uint32
	}{
		{"read past end", Request{Type: CmdRead, Offset: size - 512, Length: 1024}, nil, EINVAL},
		{"read offset overflow", Request{Type: CmdRead, Offset: ^uint64(0) - 10, Length: 4096}, nil, EINVAL},
		{"zero-length read", Request{Type: CmdRead, Offset: 0, Length: 0}, nil, EINVAL},
		{"read too big", Request{Type: CmdRead, Offset: 0, Length: MaxRequestSize + 1}, nil, EOVERFLOW},
		{"write past end", Request{Type: CmdWrite, Offset: size - 2, Length: 4}, []byte{1, 2, 3, 4}, ENOSPC},
		{"write offset overflow", Request{Type: CmdWrite, Offset: ^uint64(0), Length: 2}, []byte{5, 6}, ENOSPC},
		{"trim past end", Request{Type: CmdTrim, Offset: size, Length: 1}, nil, EINVAL},
		{"zeroes past end", Request{Type: CmdWriteZeroes, Offset: 1, Length: size}, nil, EINVAL},
		{"unknown command", Request{Type: 77, Offset: 0, Length: 10}, nil, EINVAL},
		{"cache not offered", Request{Type: CmdCache, Offset: 0, Length: 10}, nil, EINVAL},
		{"good write", Request{Type: CmdWrite, Offset: size - 4, Length: 4}, []byte{9, 9, 9, 9}, 0},
	}
	for i, tc := range cases {
		tc.req.Handle = uint64(1000 + i)
		sendReq(t, c, tc.req, tc.payload)
		r := readRep(t, c)
		if r.Handle != tc.req.Handle || r.Errno != tc.errno {
			t.Errorf("%s: reply %+v, want errno %s", tc.name, r, ErrnoName(tc.errno))
		}
	}
	for i, b := range guard {
		if b != 0xaa {
			t.Fatalf("byte %d beyond the export was changed", size+i)
		}
	}
	if !bytes.Equal(mem.data[size-4:size], []byte{9, 9, 9, 9}) {
		t.Fatal("in-range write at the last bytes did not land")
	}

	// A write larger than the maximum gets an error and the connection
	// closes: its payload cannot be skipped safely.
	sendReq(t, c, Request{Type: CmdWrite, Handle: 7, Length: MaxRequestSize + 1}, nil)
	if r := readRep(t, c); r.Errno != EOVERFLOW || r.Handle != 7 {
		t.Fatalf("oversized write: %+v", r)
	}
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := c.Read(make([]byte, 1)); err == nil {
		t.Fatal("connection still open after an oversized write")
	}

	// Bad magic closes the connection.
	c2 := rawSession(t, s, "d")
	if _, err := c2.Write(bytes.Repeat([]byte{0xff}, requestHeaderSize)); err != nil {
		t.Fatal(err)
	}
	c2.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := c2.Read(make([]byte, 1)); err == nil {
		t.Fatal("connection still open after a bad magic")
	}
}

// gateBackend blocks reads of offset 0 until released, so tests can see
// replies overtake each other and count concurrent requests.
type gateBackend struct {
	*MemBackend
	gate    chan struct{}
	active  atomic.Int64
	maxSeen atomic.Int64
	calls   atomic.Int64
}

func (g *gateBackend) ReadAt(p []byte, off int64) (int, error) {
	n := g.active.Add(1)
	defer g.active.Add(-1)
	g.calls.Add(1)
	for {
		m := g.maxSeen.Load()
		if n <= m || g.maxSeen.CompareAndSwap(m, n) {
			break
		}
	}
	if off == 0 {
		<-g.gate
	}
	return g.MemBackend.ReadAt(p, off)
}

func TestRepliesOutOfOrder(t *testing.T) {
	g := &gateBackend{MemBackend: NewMemBackend(1 << 20), gate: make(chan struct{})}
	s := newTestServer(t, &Export{Name: "d", Backend: g})
	c := rawSession(t, s, "d")
	sendReq(t, c, Request{Type: CmdRead, Handle: 1, Offset: 0, Length: 512}, nil)
	sendReq(t, c, Request{Type: CmdRead, Handle: 2, Offset: 4096, Length: 512}, nil)
	r := readRep(t, c)
	if r.Handle != 2 {
		t.Fatalf("first reply is for handle %d, want 2 (the unblocked request)", r.Handle)
	}
	if _, err := io.ReadFull(c, make([]byte, 512)); err != nil {
		t.Fatal(err)
	}
	close(g.gate)
	if r := readRep(t, c); r.Handle != 1 {
		t.Fatalf("second reply for handle %d, want 1", r.Handle)
	}
}

func TestStalledClientIsBounded(t *testing.T) {
	g := &gateBackend{MemBackend: NewMemBackend(1 << 20), gate: make(chan struct{})}
	close(g.gate)
	s := newTestServer(t, &Export{Name: "d", Backend: g})
	s.MaxInflight = 8
	c := rawSession(t, s, "d")
	// Send 200 reads and never read a reply. The server must stop reading
	// requests once 8 are held, instead of buffering 200 replies.
	go func() {
		for i := 0; i < 200; i++ {
			b := make([]byte, requestHeaderSize)
			(&Request{Type: CmdRead, Handle: uint64(i), Offset: 4096, Length: 65536}).Encode(b)
			if _, err := c.Write(b); err != nil {
				return
			}
		}
	}()
	// Wait until the server stops making progress.
	last := int64(-1)
	for i := 0; i < 100; i++ {
		time.Sleep(20 * time.Millisecond)
		n := g.calls.Load()
		if n == last && n > 0 {
			break
		}
		last = n
	}
	if n := g.calls.Load(); n > 8 {
		t.Fatalf("server executed %d requests for a client that reads nothing (limit 8)", n)
	}
	if n := g.calls.Load(); n == 0 {
		t.Fatal("server executed no request at all")
	}
}

func TestRemoveExportDrains(t *testing.T) {
	g := &gateBackend{MemBackend: NewMemBackend(1 << 20), gate: make(chan struct{})}
	s := newTestServer(t, &Export{Name: "d", Backend: g})
	c := rawSession(t, s, "d")
	sendReq(t, c, Request{Type: CmdRead, Handle: 5, Offset: 0, Length: 4096}, nil)
	for g.active.Load() == 0 {
		time.Sleep(time.Millisecond)
	}
	done := make(chan error, 1)
	go func() { done <- s.RemoveExport(context.Background(), "d") }()
	// New clients are refused at once, even while the old one drains.
	for {
		if _, ok := s.Export("d"); !ok {
			break
		}
		time.Sleep(time.Millisecond)
	}
	if _, err := NegotiateConn(context.Background(), pipeConn(t, s), "d"); !errors.Is(err, ErrUnknownExport) {
		t.Fatalf("negotiate removed export: %v", err)
	}
	select {
	case err := <-done:
		t.Fatalf("RemoveExport returned (%v) before the in-flight request finished", err)
	case <-time.After(50 * time.Millisecond):
	}
	close(g.gate)
	// The in-flight request is answered, then the connection closes.
	if r := readRep(t, c); r.Handle != 5 || r.Errno != 0 {
		t.Fatalf("in-flight reply: %+v", r)
	}
	if _, err := io.ReadFull(c, make([]byte, 4096)); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := c.Read(make([]byte, 1)); err == nil {
		t.Fatal("connection open after its export was removed")
	}
}

func TestExportConns(t *testing.T) {
	g := &gateBackend{MemBackend: NewMemBackend(1 << 20), gate: make(chan struct{})}
	s := newTestServer(t, &Export{Name: "d", Backend: g}, &Export{Name: "e", Backend: NewMemBackend(1 << 20)})
	counts := func() [3]int { return [3]int{s.ExportConns("d"), s.ExportConns("e"), s.ExportConns("x")} }
	if got := counts(); got != [3]int{} {
		t.Fatalf("connections before any client: %v", got)
	}
	c := rawSession(t, s, "d")
	cl := dialPipe(t, s, "e", 2)
	// Still negotiating: it chose no export yet.
	pipeConn(t, s)
	if got := counts(); got != [3]int{1, 2, 0} {
		t.Fatalf("connections of d, e, x = %v, want [1 2 0]", got)
	}

	// A connection of a removed export counts until its handler is done
	// (here: until its request in flight is answered).
	sendReq(t, c, Request{Type: CmdRead, Handle: 1, Offset: 0, Length: 4096}, nil)
	for g.active.Load() == 0 {
		time.Sleep(time.Millisecond)
	}
	done := make(chan error, 1)
	go func() { done <- s.RemoveExport(context.Background(), "d") }()
	for {
		if _, ok := s.Export("d"); !ok {
			break
		}
		time.Sleep(time.Millisecond)
	}
	if n := s.ExportConns("d"); n != 1 {
		t.Fatalf("connections of removed export d while it drains: %d, want 1", n)
	}
	// Counted by name: those of a new export of the same name add up.
	if err := s.AddExport(&Export{Name: "d", Backend: NewMemBackend(1 << 20)}); err != nil {
		t.Fatal(err)
	}
	c2 := rawSession(t, s, "d")
	if n := s.ExportConns("d"); n != 2 {
		t.Fatalf("connections of d, the old export draining and the new one: %d, want 2", n)
	}
	close(g.gate)
	if r := readRep(t, c); r.Handle != 1 || r.Errno != 0 {
		t.Fatalf("in-flight reply: %+v", r)
	}
	if _, err := io.ReadFull(c, make([]byte, 4096)); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	// RemoveExport returns once the handlers are done: nothing of the
	// old export is left.
	if n := s.ExportConns("d"); n != 1 {
		t.Fatalf("connections of d once the old export drained: %d, want 1 (the new export's)", n)
	}

	c2.Close()
	cl.Close()
	deadline := time.Now().Add(5 * time.Second)
	for counts() != [3]int{} {
		if time.Now().After(deadline) {
			t.Fatalf("connections after every client closed: %v", counts())
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func TestAddExportErrors(t *testing.T) {
	s := newTestServer(t, &Export{Name: "d", Backend: NewMemBackend(1)})
	for _, e := range []*Export{
		{Name: "d", Backend: NewMemBackend(1)},
		{Name: "", Backend: NewMemBackend(1)},
		{Name: "x"},
	} {
		if err := s.AddExport(e); err == nil {
			t.Errorf("AddExport(%q) succeeded", e.Name)
		}
	}
}

func TestClientFailsPendingOnClose(t *testing.T) {
	g := &gateBackend{MemBackend: NewMemBackend(1 << 20), gate: make(chan struct{})}
	s := newTestServer(t, &Export{Name: "d", Backend: g})
	cl := dialPipe(t, s, "d", 1)
	errc := make(chan error, 1)
	go func() {
		_, err := cl.ReadAt(make([]byte, 512), 0)
		errc <- err
	}()
	for g.active.Load() == 0 {
		time.Sleep(time.Millisecond)
	}
	cl.conns[0].conn.Close()
	if err := <-errc; !errors.Is(err, ErrClosed) {
		t.Fatalf("pending read after close: %v", err)
	}
	close(g.gate)
	if _, err := cl.ReadAt(make([]byte, 512), 4096); !errors.Is(err, ErrClosed) {
		t.Fatalf("read on a dead client: %v", err)
	}
}

func TestFileBackend(t *testing.T) {
	path := t.TempDir() + "/vol"
	b, err := OpenFile(path, 1<<20, true, false)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	s := newTestServer(t, &Export{Name: "f", Backend: b})
	cl := dialPipe(t, s, "f", 2)
	data := randBytes(1 << 20)
	if _, err := cl.WriteAt(data, 0); err != nil {
		t.Fatal(err)
	}
	if err := cl.Trim(0, 65536); err != nil {
		t.Fatal(err)
	}
	if err := cl.WriteZeroes(65536, 4096, true); err != nil {
		t.Fatal(err)
	}
	if err := cl.Flush(); err != nil {
		t.Fatal(err)
	}
	clear(data[:65536+4096])
	got := make([]byte, 1<<20)
	if _, err := cl.ReadAt(got, 0); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, data) {
		t.Fatal("file export read back differs")
	}
	if err := b.Resize(2 << 20); err != nil || b.Size() != 2<<20 {
		t.Fatalf("resize: %v size %d", err, b.Size())
	}
	ro, err := OpenFile(path, 4<<20, false, true)
	if err == nil {
		ro.Close()
		t.Fatal("growing a read-only file succeeded")
	}
}

func TestShutdownRefusesNewWork(t *testing.T) {
	s := &Server{Logger: quietLogger()}
	if err := s.AddExport(&Export{Name: "d", Backend: NewMemBackend(4096)}); err != nil {
		t.Fatal(err)
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	served := make(chan error, 1)
	go func() { served <- s.Serve(l) }()
	cl, err := Dial(context.Background(), DialOptions{Addr: l.Addr().String(), Export: "d", Conns: 2})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := cl.WriteAt([]byte("hello"), 0); err != nil {
		t.Fatal(err)
	}
	if mp := cl.MultipathTCP(); len(mp) != 2 || mp[0] {
		t.Fatalf("MultipathTCP = %v for a plain TCP dial", mp)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := s.Shutdown(ctx); err != nil {
		t.Fatal(err)
	}
	if err := <-served; err != nil {
		t.Fatalf("Serve: %v", err)
	}
	if _, err := cl.ReadAt(make([]byte, 5), 0); err == nil {
		t.Fatal("read succeeded after shutdown")
	}
	cl.Close()
	if err := s.Serve(l); !errors.Is(err, ErrClosed) {
		t.Fatalf("Serve after Shutdown: %v", err)
	}
}

func ExampleServer() {
	s := &Server{}
	if err := s.AddExport(&Export{Name: "disk", Backend: NewMemBackend(1 << 20)}); err != nil {
		fmt.Println(err)
		return
	}
	l, _ := net.Listen("tcp", "127.0.0.1:0")
	go s.Serve(l)
	defer s.Shutdown(context.Background())
	cl, err := Dial(context.Background(), DialOptions{Addr: l.Addr().String(), Export: "disk"})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer cl.Close()
	if _, err := cl.WriteAt([]byte("hi"), 0); err != nil {
		fmt.Println(err)
		return
	}
	b := make([]byte, 2)
	if _, err := cl.ReadAt(b, 0); err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println(string(b), cl.Size())
	// Output: hi 1048576
}
