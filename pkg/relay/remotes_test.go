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

package relay

import (
	"bufio"
	"context"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/mpnbd/mpnbd/pkg/nbd"
)

// proxy forwards TCP connections to target. It can reset a connection
// after a number of server-to-client bytes and can record what clients
// send.
type proxy struct {
	ln     net.Listener
	target string
	// cutAfter gives, for the n-th accepted connection, the number of
	// server-to-client bytes after which both sides are reset; < 0 means
	// never.
	cutAfter func(n int) int64
	cuts     atomic.Int64

	mu    sync.Mutex
	n     int
	conns []net.Conn
	up    [][]byte // client-to-server bytes, per connection
	wg    sync.WaitGroup
}

func newProxy(t testing.TB, target string, cutAfter func(int) int64) *proxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	if cutAfter == nil {
		cutAfter = func(int) int64 { return -1 }
	}
	p := &proxy{ln: ln, target: target, cutAfter: cutAfter}
	p.wg.Add(1)
	go p.accept()
	t.Cleanup(p.close)
	return p
}

func (p *proxy) addr() string { return p.ln.Addr().String() }

func (p *proxy) accept() {
	defer p.wg.Done()
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		p.mu.Lock()
		n := p.n
		p.n++
		p.conns = append(p.conns, c)
		p.up = append(p.up, nil)
		p.mu.Unlock()
		p.wg.Add(1)
		go p.handle(c, n)
	}
}

func (p *proxy) handle(c net.Conn, n int) {
	defer p.wg.Done()
	defer c.Close()
	s, err := net.Dial("tcp", p.target)
	if err != nil {
		return
	}
	defer s.Close()
	p.mu.Lock()
	p.conns = append(p.conns, s)
	p.mu.Unlock()
	upDone := make(chan struct{})
	go func() {
		defer close(upDone)
		buf := make([]byte, 64<<10)
		for {
			k, err := c.Read(buf)
			if k > 0 {
				p.mu.Lock()
				p.up[n] = append(p.up[n], buf[:k]...)
				p.mu.Unlock()
				if _, werr := s.Write(buf[:k]); werr != nil {
					break
				}
			}
			if err != nil {
				break
			}
		}
		// A proxy: whatever fails, the other side sees the end.
		_ = s.(*net.TCPConn).CloseWrite()
	}()
	limit := p.cutAfter(n)
	if limit < 0 {
		_, _ = io.Copy(c, s)
		_ = c.(*net.TCPConn).CloseWrite()
	} else {
		if k, _ := io.CopyN(c, s, limit); k == limit {
			p.cuts.Add(1)
		}
		// A cut: a reset if it can, else a FIN.
		_ = c.(*net.TCPConn).SetLinger(0)
		_ = s.(*net.TCPConn).SetLinger(0)
		c.Close()
		s.Close()
	}
	<-upDone
}

// upstream returns what the n-th client sent.
func (p *proxy) upstream(n int) []byte {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]byte(nil), p.up[n]...)
}

func (p *proxy) accepted() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.n
}

func (p *proxy) close() {
	p.ln.Close()
	p.mu.Lock()
	for _, c := range p.conns {
		c.Close()
	}
	p.mu.Unlock()
	p.wg.Wait()
}

// fakeServer speaks the transmission phase only (its dialer skips
// negotiation) and answers batches of requests in reverse order, or
// misbehaves as its mode for the connection says.
type fakeMode int

const (
	fakeReverse  fakeMode = iota // answer each batch in reverse order
	fakeBogus                    // answer the first request with a handle never sent
	fakeShutdown                 // answer everything with ESHUTDOWN, then hang up
	fakeHold                     // take requests, never answer
)

type fakeServer struct {
	ln   net.Listener
	mode func(conn int) fakeMode

	mu       sync.Mutex
	data     []byte
	n        int
	conns    []net.Conn
	order    [][]uint64 // handles received, per connection
	reversed atomic.Int64
	wg       sync.WaitGroup
}

func newFakeServer(t testing.TB, size int, mode func(int) fakeMode) *fakeServer {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	f := &fakeServer{ln: ln, mode: mode, data: make([]byte, size)}
	f.wg.Add(1)
	go f.accept()
	t.Cleanup(f.close)
	return f
}

func (f *fakeServer) dialer() Dialer {
	return func(ctx context.Context) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "tcp", f.ln.Addr().String())
	}
}

func (f *fakeServer) accept() {
	defer f.wg.Done()
	for {
		c, err := f.ln.Accept()
		if err != nil {
			return
		}
		f.mu.Lock()
		n := f.n
		f.n++
		f.conns = append(f.conns, c)
		f.order = append(f.order, nil)
		f.mu.Unlock()
		f.wg.Add(1)
		go func() {
			defer f.wg.Done()
			defer c.Close()
			f.serve(c, n, f.mode(n))
		}()
	}
}

func (f *fakeServer) close() {
	f.ln.Close()
	f.mu.Lock()
	for _, c := range f.conns {
		c.Close()
	}
	f.mu.Unlock()
	f.wg.Wait()
}

type fakeReq struct {
	req     nbd.Request
	payload []byte
	seq     int
}

// received returns the handles the n-th connection got, in order.
func (f *fakeServer) received(n int) []uint64 {
	f.mu.Lock()
	defer f.mu.Unlock()
	if n >= len(f.order) {
		return nil
	}
	return append([]uint64(nil), f.order[n]...)
}

// drop closes the n-th connection from the server side.
func (f *fakeServer) drop(n int) {
	f.mu.Lock()
	c := f.conns[n]
	f.mu.Unlock()
	c.Close()
}

func (f *fakeServer) serve(c net.Conn, n int, mode fakeMode) {
	reqs := make(chan fakeReq, 256)
	go func() {
		defer close(reqs)
		br := bufio.NewReader(c)
		var hdr [reqHeaderSize]byte
		for seq := 0; ; seq++ {
			if _, err := io.ReadFull(br, hdr[:]); err != nil {
				return
			}
			req, err := nbd.DecodeRequest(hdr[:])
			if err != nil || req.Type == nbd.CmdDisc {
				return
			}
			var p []byte
			if req.Type == nbd.CmdWrite {
				p = make([]byte, req.Length)
				if _, err := io.ReadFull(br, p); err != nil {
					return
				}
			}
			f.mu.Lock()
			f.order[n] = append(f.order[n], req.Handle)
			f.mu.Unlock()
			if mode == fakeHold {
				continue
			}
			reqs <- fakeReq{req, p, seq}
		}
	}()
	defer func() {
		c.Close()
		for range reqs {
		}
	}()
	for {
		first, ok := <-reqs
		if !ok {
			return
		}
		batch := []fakeReq{first}
		timer := time.NewTimer(3 * time.Millisecond)
	gather:
		for len(batch) < 32 {
			select {
			case q, ok := <-reqs:
				if !ok {
					break gather
				}
				batch = append(batch, q)
			case <-timer.C:
				break gather
			}
		}
		timer.Stop()
		for i := len(batch) - 1; i >= 0; i-- {
			q := batch[i]
			switch mode {
			case fakeBogus:
				_ = f.reply(c, q.req.Handle^0x5a5a5a5a, 0, nil) // then it hangs up either way
				return
			case fakeShutdown:
				if err := f.reply(c, q.req.Handle, nbd.ESHUTDOWN, nil); err != nil {
					return
				}
				continue
			}
			errno, data := f.execute(q)
			if err := f.reply(c, q.req.Handle, errno, data); err != nil {
				return
			}
		}
		if mode == fakeShutdown {
			return
		}
		if len(batch) > 1 {
			f.reversed.Add(int64(len(batch)))
		}
	}
}

func (f *fakeServer) execute(q fakeReq) (uint32, []byte) {
	f.mu.Lock()
	defer f.mu.Unlock()
	off, n := q.req.Offset, uint64(q.req.Length)
	if off+n > uint64(len(f.data)) {
		return nbd.EINVAL, nil
	}
	switch q.req.Type {
	case nbd.CmdRead:
		return 0, append([]byte(nil), f.data[off:off+n]...)
	case nbd.CmdWrite:
		copy(f.data[off:], q.payload)
	}
	return 0, nil
}

func (f *fakeServer) reply(c net.Conn, handle uint64, errno uint32, data []byte) error {
	var h [repHeaderSize]byte
	(&nbd.Reply{Handle: handle, Errno: errno}).Encode(h[:])
	_, err := c.Write(append(h[:], data...))
	return err
}
