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
	"context"
	"errors"
	"net"
	"sync/atomic"
	"testing"
	"time"

	"github.com/mpnbd/mpnbd/pkg/nbd"
)

// handRig is a relay whose local side moves from relay to relay, the way
// a datapath process hands it to its successor.
type handRig struct {
	t      *testing.T
	ts     *testServer
	kernel net.Conn
	client *nbd.Client
	relay  *Relay
	local  net.Conn
	done   chan error
	cancel context.CancelFunc
	// handoffs counts completed handovers; partial those whose pending
	// bytes held part of a frame.
	handoffs, partial atomic.Int32
}

func newHandRig(t *testing.T, ts *testServer, o Options) *handRig {
	t.Helper()
	kernel, local := kernelPair(t)
	remote, info, err := dialNegotiated(t.Context(), ts.addr, ts.mptcp)
	if err != nil {
		t.Fatal(err)
	}
	h := &handRig{t: t, ts: ts, kernel: kernel, client: nbd.NewClient(info, []net.Conn{kernel}, quietLogger())}
	h.start(local, remote, o)
	t.Cleanup(func() {
		h.cancel()
		select {
		case <-h.done:
		case <-time.After(10 * time.Second):
			t.Error("relay did not stop")
		}
		kernel.Close()
	})
	return h
}

func (h *handRig) start(local, remote net.Conn, o Options) {
	if o.Logger == nil {
		o.Logger = quietLogger()
	}
	o.ReconnectBackoff, o.MaxBackoff = 20*time.Millisecond, 200*time.Millisecond
	h.local = local
	h.relay = New(local, remote, negotiatingDialer(h.ts.addr, h.ts.mptcp), o)
	done := make(chan error, 1)
	h.done = done
	r := h.relay
	ctx, cancel := context.WithCancel(context.Background())
	h.cancel = cancel
	go func() { done <- r.Run(ctx) }()
}

// handOver pauses the current relay, takes a duplicate of its local side,
// releases it and starts a successor on the duplicate with the pending
// bytes; the successor dials the server afresh.
func (h *handRig) handOver(ctx context.Context) error {
	f, err := h.local.(*net.UnixConn).File()
	if err != nil {
		return err
	}
	defer f.Close()
	pending, err := h.relay.Pause(ctx)
	if err != nil {
		return err
	}
	if st := h.relay.Stats(); st.InFlight != 0 || st.Retained != 0 {
		return errors.New("paused with requests unanswered or writes unflushed")
	}
	h.relay.Release()
	select {
	case err := <-h.done:
		if !errors.Is(err, ErrHandedOff) {
			return err
		}
	case <-time.After(10 * time.Second):
		return errors.New("released relay did not end")
	}
	local, err := net.FileConn(f)
	if err != nil {
		return err
	}
	if len(pending) > 0 {
		h.partial.Add(1)
	}
	h.start(local, nil, Options{Pending: pending})
	h.handoffs.Add(1)
	return nil
}

// Writes at queue depth 16 run while the local side moves through three
// relays in turn: none fails, the backend ends up with every byte, and
// each handover left nothing unanswered or unflushed behind.
func TestHandOverMidWrite(t *testing.T) {
	checkGoroutines(t)
	size := restartSize()
	ts := newTestServer(t, int64(size), false)
	h := newHandRig(t, ts, Options{})
	src := randomData(size, 21)
	handErr := make(chan error, 1)
	errs := pump(size, func(off int) error {
		_, err := h.client.WriteAt(src[off:off+chunk], int64(off))
		return err
	}, func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		for i := 0; i < 2; i++ {
			if err := h.handOver(ctx); err != nil {
				handErr <- err
				return
			}
		}
		handErr <- nil
	})
	select {
	case err := <-handErr:
		if err != nil {
			t.Fatalf("handover: %v", err)
		}
	case <-time.After(60 * time.Second):
		t.Fatal("handovers did not finish")
	}
	if len(errs) > 0 {
		t.Fatalf("%d write errors across the handovers, first: %v", len(errs), errs[0])
	}
	if err := h.client.Flush(); err != nil {
		t.Fatal(err)
	}
	backend := make([]byte, size)
	if _, err := ts.backend.ReadAt(backend, 0); err != nil {
		t.Fatal(err)
	}
	if sum(backend) != sum(src) {
		t.Fatal("sha256 of the backend differs from what was written")
	}
	t.Logf("handovers %d (with part of a frame pending: %d)", h.handoffs.Load(), h.partial.Load())
}

// Part of a write frame sits in the relay's buffer when it pauses: the
// successor gets exactly those bytes and completes the request with the
// rest, which the kernel sends only then.
func TestHandOverPartialFrame(t *testing.T) {
	checkGoroutines(t)
	ts := newTestServer(t, 1<<20, false)
	kernel, local := kernelPair(t)
	defer kernel.Close()
	h := &handRig{t: t, ts: ts, kernel: kernel}
	remote, _, err := dialNegotiated(t.Context(), ts.addr, false)
	if err != nil {
		t.Fatal(err)
	}
	h.start(local, remote, Options{})
	defer func() { h.cancel(); <-h.done }()

	payload := randomData(64<<10, 22)
	var hdr [reqHeaderSize]byte
	(&nbd.Request{Type: nbd.CmdWrite, Handle: 7, Offset: 4096, Length: uint32(len(payload))}).Encode(hdr[:])
	frame := append(hdr[:], payload...)
	half := reqHeaderSize + len(payload)/2
	if _, err := kernel.Write(frame[:half]); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 5*time.Second, "the relay to read the first half", func() bool {
		return h.relay.Stats().BytesFromLocal >= reqHeaderSize
	})
	time.Sleep(50 * time.Millisecond) // let it read the rest of what was sent
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	f, err := h.local.(*net.UnixConn).File()
	if err != nil {
		t.Fatal(err)
	}
	pending, err := h.relay.Pause(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if string(pending) != string(frame[:half]) {
		t.Fatalf("pending holds %d bytes, want the %d sent so far", len(pending), half)
	}
	h.relay.Release()
	if err := <-h.done; !errors.Is(err, ErrHandedOff) {
		t.Fatalf("Run of the released relay: %v", err)
	}
	next, err := net.FileConn(f)
	f.Close()
	if err != nil {
		t.Fatal(err)
	}
	h.start(next, nil, Options{Pending: pending})
	if _, err := kernel.Write(frame[half:]); err != nil {
		t.Fatal(err)
	}
	kernel.SetReadDeadline(time.Now().Add(10 * time.Second))
	var rep [repHeaderSize]byte
	if _, err := readFull(kernel, rep[:]); err != nil {
		t.Fatalf("reply: %v", err)
	}
	r, err := nbd.DecodeReply(rep[:])
	if err != nil || r.Handle != 7 || r.Errno != 0 {
		t.Fatalf("reply %+v, %v", r, err)
	}
	got := make([]byte, len(payload))
	if _, err := ts.backend.ReadAt(got, 4096); err != nil {
		t.Fatal(err)
	}
	if sum(got) != sum(payload) {
		t.Fatal("the write completed by the successor did not land")
	}
}

// A pause that cannot complete (the server is away, a write waits) gives
// up at its deadline and the relay serves on: the write lands once the
// server is back.
func TestPauseTimesOutAndResumes(t *testing.T) {
	checkGoroutines(t)
	ts := newTestServer(t, 8<<20, false)
	h := newHandRig(t, ts, Options{})
	ts.kill()
	src := randomData(chunk, 23)
	wrote := make(chan error, 1)
	go func() {
		_, err := h.client.WriteAt(src, 0)
		wrote <- err
	}()
	waitFor(t, 5*time.Second, "the write to be taken", func() bool { return h.relay.Stats().InFlight == 1 })
	ctx, cancel := context.WithTimeout(t.Context(), 300*time.Millisecond)
	defer cancel()
	if _, err := h.relay.Pause(ctx); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Pause with the server away: %v, want the deadline", err)
	}
	ts.start()
	select {
	case err := <-wrote:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("the write did not complete after the server came back")
	}
	// The request path reads on after the failed pause.
	if _, err := h.client.WriteAt(src, chunk); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, 2*chunk)
	if _, err := ts.backend.ReadAt(got, 0); err != nil {
		t.Fatal(err)
	}
	if sum(got[:chunk]) != sum(src) || sum(got[chunk:]) != sum(src) {
		t.Fatal("the writes did not land")
	}
}

func readFull(c net.Conn, b []byte) (int, error) {
	n := 0
	for n < len(b) {
		m, err := c.Read(b[n:])
		n += m
		if err != nil {
			return n, err
		}
	}
	return n, nil
}
