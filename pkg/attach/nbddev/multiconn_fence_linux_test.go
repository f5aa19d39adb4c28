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

package nbddev

import (
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"io"
	"net"
	"os"
	"testing"
	"time"

	"github.com/mpnbd/mpnbd/internal/testenv/topo"
	"github.com/mpnbd/mpnbd/pkg/attach"
	"github.com/mpnbd/mpnbd/pkg/nbd"
)

// TestMulticonnNoLateWriteAfterSilentPath: the multiconn transport over
// two paths, its sockets made by the attacher as for the kernel, the
// kernel's part played by this test on the same sockets. Path 1 falls
// silent (nftables drops its packets at the storage host: no reset) with
// a write to block X queued on its socket. As the kernel does, the test
// requeues that write on path 2's socket when the request timeout
// passes, then writes newer data to X there and FLUSHes. Then path 1
// comes back. The old write must never land: its socket died of the
// dead-peer bound (TCP_USER_TIMEOUT) before the requeue, taking what it
// had not sent with it, and the server ended its side too. Without that,
// TCP delivers the old write when the path returns, over the newer,
// flushed data.
func TestMulticonnNoLateWriteAfterSilentPath(t *testing.T) {
	topo.RequireNft(t)
	if !topo.InFreshNetns(t) {
		return
	}
	cfg := topo.Uniform(topo.UniqueName("mc"), 2, 1000)
	cfg.ClientInCaller, cfg.PlainTCP = true, true
	tp := topo.NewForTest(t, cfg)

	const bound = 2 * time.Second
	const blk = 4096
	const x = 64 * blk // block X
	backend := nbd.NewMemBackend(1 << 20)
	srv := &nbd.Server{Logger: quiet(), DeadPeerTimeout: bound}
	if err := srv.AddExport(&nbd.Export{Name: "vol", Backend: backend}); err != nil {
		t.Fatal(err)
	}
	var ln net.Listener
	if err := tp.InServer(func() error {
		var err error
		ln, err = net.Listen("tcp", "0.0.0.0:10809")
		return err
	}); err != nil {
		t.Fatal(err)
	}
	go srv.Serve(ln)
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		srv.Shutdown(ctx)
	})

	k := newFakeKernel()
	k.holdSockets = true
	t.Cleanup(func() {
		for _, f := range k.held {
			f.Close()
		}
	})
	a, err := New(Config{Mode: attach.MultiConn, Kernel: k, Devices: &fakeDevices{backends: map[string]uint32{}}, Logger: quiet()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(a.Close)
	tg := attach.Target{VolumeID: "pvc-mc", Export: "vol",
		Addrs:      []string{net.JoinHostPort(tp.ServerAddr(1).String(), "10809"), net.JoinHostPort(tp.ServerAddr(2).String(), "10809")},
		LocalAddrs: []string{tp.ClientAddr(1).String(), tp.ClientAddr(2).String()}}
	if _, err := a.Attach(context.Background(), tg, attach.Options{DeadPeerTimeout: bound, RequestTimeout: 2 * bound}); err != nil {
		t.Fatal(err)
	}
	k.mu.Lock()
	requestTimeout := k.connects[0].Timeout
	held := append([]*os.File(nil), k.held...)
	k.mu.Unlock()
	if len(held) != 2 {
		t.Fatalf("%d sockets handed to the kernel, want one per path", len(held))
	}
	var sockA, sockB net.Conn // on path 1 and path 2
	for _, f := range held {
		c, err := net.FileConn(f)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		if c.LocalAddr().(*net.TCPAddr).IP.Equal(tp.ClientAddr(1).AsSlice()) {
			sockA = c
		} else {
			sockB = c
		}
	}
	if sockA == nil || sockB == nil {
		t.Fatal("no socket on each path")
	}
	exp, _ := srv.Export("vol")
	old := bytes.Repeat([]byte{0xaa}, blk)
	newer := bytes.Repeat([]byte{0xbb}, blk)

	if err := topo.Drop(tp.ServerNS, "path1", tp.Paths[0].ServerIf); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = topo.Undrop(tp.ServerNS, "path1") })
	sentAt := time.Now()
	send(t, sockA, nbd.Request{Type: nbd.CmdWrite, Handle: 1, Offset: x, Length: blk}, old)

	// The kernel requeues the request once its timeout passes.
	time.Sleep(time.Until(sentAt.Add(requestTimeout)))
	aDead := dead(sockA)
	t.Logf("request timeout %v: path 1's socket dead before the requeue: %v", requestTimeout, aDead)
	send(t, sockB, nbd.Request{Type: nbd.CmdWrite, Handle: 1, Offset: x, Length: blk}, old)
	expectReply(t, sockB, 1)
	send(t, sockB, nbd.Request{Type: nbd.CmdWrite, Handle: 2, Offset: x, Length: blk}, newer)
	expectReply(t, sockB, 2)
	send(t, sockB, nbd.Request{Type: nbd.CmdFlush, Handle: 3}, nil)
	expectReply(t, sockB, 3)

	if err := topo.Undrop(tp.ServerNS, "path1"); err != nil {
		t.Fatal(err)
	}
	liftedAt := time.Now()
	// A late delivery would come with path 1's next retransmission, at
	// most a backoff step (a few seconds here) after the path is back. It
	// cannot come at all once both ends of path 1's connection are gone.
	at := func() []byte {
		b := make([]byte, blk)
		if _, err := backend.ReadAt(b, x); err != nil {
			t.Fatal(err)
		}
		return b
	}
	const lateBound = 15 * time.Second
	for {
		if bytes.Equal(at(), old) {
			t.Fatalf("the write queued on the silent path landed %v after the path came back, over newer flushed data", time.Since(liftedAt).Round(time.Millisecond))
		}
		if dead(sockA) && exp.ConnCount() == 1 {
			break
		}
		if time.Since(liftedAt) > lateBound {
			t.Fatalf("path 1's connection still open %v after the path came back (client end dead: %v, server connections %d)", lateBound, dead(sockA), exp.ConnCount())
		}
		time.Sleep(50 * time.Millisecond)
	}
	if got, want := sha256.Sum256(at()), sha256.Sum256(newer); got != want {
		t.Fatalf("block X: sha256 %x, want %x (the newer write)", got, want)
	}
	t.Logf("path 1's connection gone at both ends %v after the path came back; block X holds the newer write", time.Since(liftedAt).Round(time.Millisecond))
	if !aDead {
		t.Fatal("path 1's socket was still alive when the kernel requeued its request: a late delivery was possible")
	}
}

func send(t *testing.T, c net.Conn, r nbd.Request, payload []byte) {
	t.Helper()
	b := make([]byte, 28+len(payload))
	r.Encode(b)
	copy(b[28:], payload)
	if _, err := c.Write(b); err != nil {
		t.Fatalf("send %+v: %v", r, err)
	}
}

func expectReply(t *testing.T, c net.Conn, handle uint64) {
	t.Helper()
	var b [16]byte
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	defer c.SetReadDeadline(time.Time{})
	if _, err := io.ReadFull(c, b[:]); err != nil {
		t.Fatalf("reply %d: %v", handle, err)
	}
	r, err := nbd.DecodeReply(b[:])
	if err != nil || r.Handle != handle || r.Errno != 0 {
		t.Fatalf("reply %+v (%v), want handle %d without error", r, err, handle)
	}
}

// dead reports whether c's socket has failed (the kernel reports the
// error on the next read), as opposed to merely having nothing to read.
func dead(c net.Conn) bool {
	c.SetReadDeadline(time.Now().Add(10 * time.Millisecond))
	defer c.SetReadDeadline(time.Time{})
	var b [1]byte
	_, err := c.Read(b[:])
	return err != nil && !errors.Is(err, os.ErrDeadlineExceeded)
}
