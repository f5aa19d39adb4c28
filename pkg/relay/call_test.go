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
	"errors"
	"net"
	"testing"
	"time"

	"github.com/mpnbd/mpnbd/pkg/nbd"
)

// startLocal runs a relay without a local connection (in-process calls).
func startLocal(t *testing.T, remote net.Conn, dial Dialer, o Options) *Relay {
	t.Helper()
	if o.Logger == nil {
		o.Logger = quietLogger()
	}
	r := New(nil, remote, dial, o)
	done := make(chan error, 1)
	ctx, cancel := context.WithCancel(context.Background())
	go func() { done <- r.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			t.Error("relay did not stop")
		}
	})
	return r
}

// startCalls starts a test server of size bytes and, in front of it, a
// relay without a local connection (a session) and a client on it.
func startCalls(t *testing.T, size int64, o Options) (*testServer, *Relay, *nbd.Client) {
	t.Helper()
	ts := newTestServer(t, size, false)
	dial := sessionDialer(ts.addr, nbd.NewSessionID())
	remote, err := dial(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	r := startLocal(t, remote, dial, o)
	return ts, r, nbd.NewClientOn(remote.(*Remote).Info, r, quietLogger())
}

// TestCallsRideOutServerRestarts: block I/O through an in-process relay
// sees no error while the server is killed and restarted under it, and
// every byte reads back.
func TestCallsRideOutServerRestarts(t *testing.T) {
	checkGoroutines(t)
	ts, r, cl := startCalls(t, 8<<20, Options{ReconnectBackoff: time.Millisecond})
	want := randomData(8<<20, 3)
	for i := 0; i < 32; i++ {
		off := int64(i) * 256 << 10
		if i%8 == 3 {
			ts.kill()
			go func() { time.Sleep(50 * time.Millisecond); ts.start() }()
		}
		if _, err := cl.WriteAt(want[off:off+256<<10], off); err != nil {
			t.Fatalf("write %d: %v", i, err)
		}
	}
	if err := cl.WriteZeroes(0, 64<<10, false); err != nil {
		t.Fatal(err)
	}
	clear(want[:64<<10])
	if err := cl.Flush(); err != nil {
		t.Fatal(err)
	}
	ts.kill()
	ts.start()
	got := make([]byte, len(want))
	if _, err := cl.ReadAt(got, 0); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) {
		t.Fatal("data read back differs from what was written")
	}
	if st := r.Stats(); st.Reconnects < 4 {
		t.Fatalf("%d reconnects, want at least 4", st.Reconnects)
	}
	// Errors from the server reach the caller as such.
	var ne *nbd.Error
	if _, err := cl.ReadAt(make([]byte, 4096), 8<<20); !errors.As(err, &ne) || ne.Errno != nbd.EINVAL {
		t.Fatalf("read past the end: %v, want EINVAL", err)
	}
	if err := cl.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := cl.ReadAt(got[:4096], 0); !errors.Is(err, ErrClosed) {
		t.Fatalf("read after Close: %v, want ErrClosed", err)
	}
}

// TestCallsFailAfter: with FailAfter set, calls waiting for a server
// that stays away fail with an EIO reply, and the relay serves them again
// once the server is back.
func TestCallsFailAfter(t *testing.T) {
	ts, _, cl := startCalls(t, 1<<20, Options{ReconnectBackoff: time.Millisecond, MaxBackoff: 20 * time.Millisecond, FailAfter: 300 * time.Millisecond})
	ts.kill()
	_, err := cl.WriteAt(make([]byte, 4096), 0)
	var nerr *nbd.Error
	if !errors.As(err, &nerr) || nerr.Errno != nbd.EIO {
		t.Fatalf("write with the server gone: %v, want an EIO reply", err)
	}
	ts.start()
	deadline := time.Now().Add(10 * time.Second)
	for {
		_, err = cl.WriteAt(make([]byte, 4096), 0)
		if err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("writes still fail 10s after the server came back: %v", err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestWriteOwned: a write handing its buffer over lands like any other;
// one that is not a write, or whose buffer is shorter than its length, is
// refused and sends nothing.
func TestWriteOwned(t *testing.T) {
	_, r, cl := startCalls(t, 1<<20, Options{})
	want := randomData(256<<10, 5)
	buf := Buffer(len(want))
	copy(*buf, want)
	if err := r.WriteOwned(nbd.Request{Type: nbd.CmdWrite, Offset: 64 << 10, Length: uint32(len(want))}, buf); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, len(want))
	if _, err := cl.ReadAt(got, 64<<10); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) {
		t.Fatal("an owned write reads back different")
	}
	if err := r.WriteOwned(nbd.Request{Type: nbd.CmdRead, Length: 4096}, Buffer(4096)); err == nil {
		t.Fatal("WriteOwned took a read")
	}
	if err := r.WriteOwned(nbd.Request{Type: nbd.CmdWrite, Length: 8192}, Buffer(4096)); err == nil {
		t.Fatal("WriteOwned took a buffer shorter than the write")
	}
	if _, err := cl.ReadAt(got[:4096], 0); err != nil || !bytes.Equal(got[:4096], make([]byte, 4096)) {
		t.Fatalf("a refused write reached the export (err %v)", err)
	}
}

// TestStartAndPush: requests started one after another reach the server
// together once pushed, each completion arrives once with its outcome (an
// error reply as such), and a request started after Close fails at once.
func TestStartAndPush(t *testing.T) {
	_, r, cl := startCalls(t, 1<<20, Options{})
	const n = 32
	want := randomData(n*4096, 9)
	results := make(chan error, n)
	for i := 0; i < n; i++ {
		var owned *[]byte
		if i%2 == 1 {
			owned = Buffer(4096)
			copy(*owned, want[i*4096:(i+1)*4096])
		}
		r.Start(nbd.Request{Type: nbd.CmdWrite, Offset: uint64(i) * 4096, Length: 4096}, want[i*4096:(i+1)*4096], owned, nil,
			func(err error) { results <- err })
	}
	r.Push()
	for i := 0; i < n; i++ {
		select {
		case err := <-results:
			if err != nil {
				t.Fatalf("write %d: %v", i, err)
			}
		case <-time.After(10 * time.Second):
			t.Fatalf("%d of %d started writes completed in 10s", i, n)
		}
	}
	got := make([]byte, len(want))
	done := make(chan error, 2)
	r.Start(nbd.Request{Type: nbd.CmdRead, Length: uint32(len(got))}, nil, nil, got, func(err error) { done <- err })
	r.Start(nbd.Request{Type: nbd.CmdRead, Offset: 1 << 20, Length: 4096}, nil, nil, make([]byte, 4096), func(err error) { done <- err })
	r.Push()
	var nerr *nbd.Error
	for i := 0; i < 2; i++ {
		select {
		case err := <-done:
			if err != nil && (!errors.As(err, &nerr) || nerr.Errno != nbd.EINVAL) {
				t.Fatalf("read: %v", err)
			}
		case <-time.After(10 * time.Second):
			t.Fatal("a started read did not complete in 10s")
		}
	}
	if nerr == nil {
		t.Fatal("the read past the end did not get its EINVAL reply")
	}
	if !bytes.Equal(got, want) {
		t.Fatal("started writes read back different")
	}
	if err := cl.Close(); err != nil {
		t.Fatal(err)
	}
	calls := 0
	var after error
	r.Start(nbd.Request{Type: nbd.CmdRead, Length: 4096}, nil, nil, make([]byte, 4096), func(err error) { calls++; after = err })
	if calls != 1 || !errors.Is(after, ErrClosed) {
		t.Fatalf("a request started after Close: %d completions, %v; want one, ErrClosed", calls, after)
	}
}
