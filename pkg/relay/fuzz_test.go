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
	"bytes"
	"context"
	"io"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/mpnbd/mpnbd/pkg/nbd"
)

// The requests in flight while the fuzzer plays the remote.
var fuzzRequests = []nbd.Request{
	{Type: nbd.CmdRead, Handle: 1, Offset: 0, Length: 8},
	{Type: nbd.CmdWrite, Handle: 2, Offset: 4096, Length: 4},
	{Type: nbd.CmdRead, Handle: 3, Offset: 512, Length: 3},
	{Type: nbd.CmdFlush, Handle: 4},
	{Type: nbd.CmdTrim, Handle: 5, Offset: 0, Length: 4096},
	{Type: nbd.CmdRead, Handle: 0xfeedface00000006, Offset: 8192, Length: 0},
}

func fuzzRequestBytes() []byte {
	var out []byte
	var hdr [reqHeaderSize]byte
	for _, q := range fuzzRequests {
		q.Encode(hdr[:])
		out = append(out, hdr[:]...)
		if q.Type == nbd.CmdWrite {
			out = append(out, bytes.Repeat([]byte{0xab}, int(q.Length))...)
		}
	}
	return out
}

// scriptedRemote is a remote connection that swallows requests and, once
// it has them all, answers with a fixed byte string in small reads, then
// EOF.
type scriptedRemote struct {
	mu     sync.Mutex
	cond   sync.Cond
	got    []byte
	want   int
	reply  []byte
	step   int
	closed bool
}

func newScriptedRemote(want int, reply []byte) *scriptedRemote {
	s := &scriptedRemote{want: want, reply: reply, step: 1 + len(reply)%23}
	s.cond.L = &s.mu
	return s
}

func (s *scriptedRemote) Read(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for len(s.got) < s.want && !s.closed {
		s.cond.Wait()
	}
	if s.closed {
		return 0, net.ErrClosed
	}
	if len(s.reply) == 0 {
		return 0, io.EOF
	}
	n := copy(p[:min(len(p), s.step)], s.reply)
	s.reply = s.reply[n:]
	return n, nil
}

func (s *scriptedRemote) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return 0, net.ErrClosed
	}
	s.got = append(s.got, p...)
	s.cond.Broadcast()
	return len(p), nil
}

func (s *scriptedRemote) Close() error {
	s.mu.Lock()
	s.closed = true
	s.mu.Unlock()
	s.cond.Broadcast()
	return nil
}

func (s *scriptedRemote) sent() []byte {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]byte(nil), s.got...)
}

func (s *scriptedRemote) LocalAddr() net.Addr              { return &net.TCPAddr{} }
func (s *scriptedRemote) RemoteAddr() net.Addr             { return &net.TCPAddr{} }
func (s *scriptedRemote) SetDeadline(time.Time) error      { return nil }
func (s *scriptedRemote) SetReadDeadline(time.Time) error  { return nil }
func (s *scriptedRemote) SetWriteDeadline(time.Time) error { return nil }

// FuzzRelayRemote feeds arbitrary bytes as the remote's replies while
// requests are in flight. The relay must not panic, must forward each
// request once and in order, and must give the local side only whole,
// well-formed replies, each for a request in flight and at most once.
func FuzzRelayRemote(f *testing.F) {
	// The seed corpus is in testdata/fuzz/FuzzRelayRemote: replies in and
	// out of order, errors, duplicates, unknown handles, ESHUTDOWN, bad
	// magic, and streams cut inside a header or a read payload.
	f.Add([]byte{})

	reqBytes := fuzzRequestBytes()
	byHandle := map[uint64]nbd.Request{}
	for _, q := range fuzzRequests {
		byHandle[q.Handle] = q
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		local, kernel := net.Pipe()
		remote := newScriptedRemote(len(reqBytes), data)
		redialed := make(chan struct{})
		var once sync.Once
		dial := func(ctx context.Context) (net.Conn, error) {
			once.Do(func() { close(redialed) })
			<-ctx.Done()
			return nil, ctx.Err()
		}
		r := New(local, remote, dial, Options{Logger: quietLogger(), ReconnectBackoff: time.Millisecond})
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		runDone := make(chan error, 1)
		go func() { runDone <- r.Run(ctx) }()
		writeDone := make(chan struct{})
		go func() {
			defer close(writeDone)
			// Fails once the relay drops a connection that broke the
			// protocol: what the fuzzer looks for is a crash.
			_, _ = kernel.Write(reqBytes)
		}()
		var got bytes.Buffer
		readDone := make(chan struct{})
		go func() {
			defer close(readDone)
			_, _ = io.Copy(&got, kernel) // until the relay closes its end
		}()

		// Every byte of data is consumed and every reply delivered by the
		// time the relay, having lost the remote, dials again.
		select {
		case <-redialed:
		case err := <-runDone:
			t.Fatalf("Run ended early: %v", err)
		case <-time.After(10 * time.Second):
			t.Fatal("the relay neither finished the input nor redialled")
		}
		cancel()
		<-runDone
		<-readDone
		<-writeDone
		kernel.Close()

		if sent := remote.sent(); !bytes.Equal(sent, reqBytes) {
			t.Fatalf("the remote got %x, want the requests once, in order: %x", sent, reqBytes)
		}
		stream := got.Bytes()
		seen := map[uint64]bool{}
		for len(stream) > 0 {
			if len(stream) < repHeaderSize {
				t.Fatalf("partial reply header at the end: %x", stream)
			}
			rep, err := nbd.DecodeReply(stream)
			if err != nil {
				t.Fatalf("malformed reply to the local side: %v", err)
			}
			q, ok := byHandle[rep.Handle]
			if !ok {
				t.Fatalf("reply for unknown handle %#x reached the local side", rep.Handle)
			}
			if seen[rep.Handle] {
				t.Fatalf("second reply for handle %#x reached the local side", rep.Handle)
			}
			if rep.Errno == nbd.ESHUTDOWN {
				t.Fatalf("ESHUTDOWN reached the local side for handle %#x", rep.Handle)
			}
			seen[rep.Handle] = true
			n := repHeaderSize
			if q.Type == nbd.CmdRead && rep.Errno == 0 {
				n += int(q.Length)
			}
			if len(stream) < n {
				t.Fatalf("reply for handle %#x cut short: %d of %d bytes", rep.Handle, len(stream), n)
			}
			stream = stream[n:]
		}
	})
}
