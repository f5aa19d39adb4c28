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
	"errors"
	"io"
	"net"
	"testing"
	"time"

	"github.com/mpnbd/mpnbd/internal/testenv/powerloss"
	"github.com/mpnbd/mpnbd/pkg/attach"
	"github.com/mpnbd/mpnbd/pkg/nbd"
)

// kernelWrite writes p at off as the kernel would, on its end of the
// relay's socket, and waits for the reply.
func kernelWrite(t *testing.T, c net.Conn, p []byte, off uint64) {
	t.Helper()
	hdr := make([]byte, 28)
	req := nbd.Request{Type: nbd.CmdWrite, Handle: 1, Offset: off, Length: uint32(len(p))}
	req.Encode(hdr)
	c.SetDeadline(time.Now().Add(20 * time.Second))
	defer c.SetDeadline(time.Time{})
	if _, err := c.Write(append(hdr, p...)); err != nil {
		t.Fatal(err)
	}
	rep := make([]byte, 16)
	if _, err := io.ReadFull(c, rep); err != nil {
		t.Fatal(err)
	}
	if errno := rep[4:8]; !bytes.Equal(errno, []byte{0, 0, 0, 0}) {
		t.Fatalf("the write failed: errno %v", errno)
	}
}

// TestRelayDetachWithTheStorageNodeAwayFails: a relay's detach while the
// storage node is away (it lost power, its cache with it) and the relay
// retains a write it acknowledged fails and leaves the device; once the
// node is back, the next detach flushes the write and disconnects.
func TestRelayDetachWithTheStorageNodeAwayFails(t *testing.T) {
	node := powerloss.Start(t, 1<<20)
	k := newFakeKernel()
	k.holdSockets = true
	a := attachRelay(t, k, node)
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	k.mu.Lock()
	held := k.held
	k.mu.Unlock()
	if len(held) != 1 {
		t.Fatalf("the kernel holds %d sockets", len(held))
	}
	kc, err := net.FileConn(held[0])
	if err != nil {
		t.Fatal(err)
	}
	defer kc.Close()
	data := bytes.Repeat([]byte("retained by the relay "), 4096/22+1)[:4096]
	kernelWrite(t, kc, data, 4096)
	node.PowerLoss()
	dctx, dcancel := context.WithTimeout(t.Context(), 500*time.Millisecond)
	err = a.Detach(dctx, "pvc-1")
	dcancel()
	if !errors.Is(err, attach.ErrUnflushed) {
		t.Fatalf("a detach with an unflushed write and the storage node away: %v, want ErrUnflushed", err)
	}
	k.mu.Lock()
	disconnects := len(k.disconnects)
	k.mu.Unlock()
	if disconnects != 0 {
		t.Fatal("the failed detach disconnected the device")
	}
	node.Restore()
	if err := a.Detach(ctx, "pvc-1"); err != nil {
		t.Fatalf("the detach once the storage node is back: %v", err)
	}
	if got := node.Durable(4096, 4096); !bytes.Equal(got, data) {
		t.Fatal("a write the relay acknowledged is not on the storage node's medium after the detach")
	}
}

// TestRelayDetachOfAPausedRelayFails: a detach that finds the relay
// paused already (an earlier detach still draining it, or a handoff under
// way) does not end it: the writes it retains are the pausing one's to
// flush.
func TestRelayDetachOfAPausedRelayFails(t *testing.T) {
	node := powerloss.Start(t, 1<<20)
	k := newFakeKernel()
	// The kernel holds its end of the relay's socket pair: without it the
	// relay sees it closed and ends, before or after the handoff pauses it.
	k.holdSockets = true
	a := attachRelay(t, k, node)
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	h, err := a.HandOff(ctx, "pvc-1")
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		for _, f := range h.Files {
			f.Close()
		}
	}()
	if err := a.Detach(ctx, "pvc-1"); !errors.Is(err, attach.ErrUnflushed) {
		t.Fatalf("a detach of a paused relay: %v, want ErrUnflushed", err)
	}
	k.mu.Lock()
	disconnects := len(k.disconnects)
	k.mu.Unlock()
	if disconnects != 0 {
		t.Fatal("the detach disconnected a device whose relay another one paused")
	}
	if err := h.Resume(); err != nil {
		t.Fatal(err)
	}
	if err := a.Detach(ctx, "pvc-1"); err != nil {
		t.Fatalf("the detach once the relay serves again: %v", err)
	}
}

// attachRelay attaches volume pvc-1 over the relay transport to node's
// export, on kernel k.
func attachRelay(t *testing.T, k *fakeKernel, node *powerloss.Node) *Attacher {
	t.Helper()
	a, err := New(Config{Mode: attach.Relay, Kernel: k, Devices: &fakeDevices{backends: map[string]uint32{}}, Logger: quiet()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(a.Close)
	tg := attach.Target{VolumeID: "pvc-1", Export: powerloss.Export, Addrs: []string{node.Addr}}
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	if _, err := a.Attach(ctx, tg, attach.Options{}); err != nil {
		t.Fatal(err)
	}
	return a
}
