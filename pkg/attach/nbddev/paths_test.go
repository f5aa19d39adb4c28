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
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/mpnbd/mpnbd/pkg/attach"
	"github.com/mpnbd/mpnbd/pkg/nbd"
	"github.com/mpnbd/mpnbd/pkg/nbd/nbdnl"
)

// deadAddrs returns an address that refuses connections and one that
// accepts but never answers the handshake (a path that is down, as far as
// a dial can tell).
func deadAddrs(t *testing.T) (refused, silent string) {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	refused = l.Addr().String()
	l.Close()
	sl, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { sl.Close() })
	go func() {
		for {
			c, err := sl.Accept()
			if err != nil {
				return
			}
			t.Cleanup(func() { c.Close() })
		}
	}()
	return refused, sl.Addr().String()
}

// TestAttachSkipsDeadAddresses: with the first storage addresses' paths
// down, attach, reconnect and resize go through the one that works (for
// multiconn: the device gets the one connection that works).
func TestAttachSkipsDeadAddresses(t *testing.T) {
	for _, mode := range []attach.Transport{attach.TCP, attach.MultiConn} {
		t.Run(string(mode), func(t *testing.T) {
			s, good := startServer(t)
			refused, silent := deadAddrs(t)
			k := newFakeKernel()
			a, err := New(Config{Mode: mode, Kernel: k, Devices: &fakeDevices{backends: map[string]uint32{}}, Logger: quiet(), DialTimeout: 6 * time.Second})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(a.Close)
			tg := attach.Target{VolumeID: "pvc-1", Export: "vol", Addrs: []string{silent, refused, good}}
			if _, err := a.Attach(context.Background(), tg, attach.Options{}); err != nil {
				t.Fatalf("attach with the first two paths down: %v", err)
			}
			waitConns(t, s, 1)
			// The address that worked is tried first from now on: a
			// reconnect does not wait on the dead ones again.
			start := time.Now()
			k.linkDead <- nbdnl.LinkDead{Index: 0}
			select {
			case <-k.reconfigured:
			case <-time.After(10 * time.Second):
				t.Fatal("no RECONFIGURE after LINK_DEAD")
			}
			// Under the dial timeout (6s): no wait on the silent address
			// beyond multiconn's grace for the others (2s).
			if d := time.Since(start); d > 4*time.Second {
				t.Errorf("reconnect took %v: it waited on a dead address", d)
			}
			if mode == attach.MultiConn {
				// The kernel gets the one connection that works (the fake
				// does not shut the replaced socket down as the kernel does).
				k.mu.Lock()
				n := len(k.reconfigs[len(k.reconfigs)-1].Sockets)
				k.mu.Unlock()
				if n != 1 {
					t.Fatalf("RECONFIGURE with %d sockets, want the one that works", n)
				}
			} else {
				waitConns(t, s, 1)
			}
			if _, err := a.Resize(context.Background(), "pvc-1", 1<<20); err != nil {
				t.Fatalf("resize: %v", err)
			}
		})
	}
}

// TestReconnectUntilServerBack: a reconnect does not give up while the
// server is away, even past a bounded deadConnTimeout; it succeeds once
// the server is back, and LINK_DEAD events meanwhile start no second one.
func TestReconnectUntilServerBack(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	s := &nbd.Server{Logger: quiet()}
	if err := s.AddExport(&nbd.Export{Name: "vol", Backend: nbd.NewMemBackend(1 << 20)}); err != nil {
		t.Fatal(err)
	}
	go s.Serve(l)
	k := newFakeKernel()
	k.linkDead = make(chan nbdnl.LinkDead, 8)
	a, err := New(Config{Mode: attach.TCP, Kernel: k, Devices: &fakeDevices{backends: map[string]uint32{}}, Logger: quiet(), DialTimeout: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(a.Close)
	tg := attach.Target{VolumeID: "pvc-1", Export: "vol", Addrs: []string{addr}}
	if _, err := a.Attach(context.Background(), tg, attach.Options{DeadConnTimeout: 500 * time.Millisecond}); err != nil {
		t.Fatal(err)
	}
	s.Shutdown(context.Background())
	for i := 0; i < 5; i++ {
		k.linkDead <- nbdnl.LinkDead{Index: 0}
	}
	time.Sleep(2 * time.Second) // well past deadConnTimeout
	k.mu.Lock()
	n := len(k.reconfigs)
	k.mu.Unlock()
	if n != 0 {
		t.Fatalf("%d RECONFIGUREs while the server was down", n)
	}
	s2 := serveAgain(t, addr)
	waitReconfigured(t, k)
	waitConns(t, s2, 1)
	time.Sleep(300 * time.Millisecond)
	k.mu.Lock()
	n = len(k.reconfigs)
	k.mu.Unlock()
	if n != 1 {
		t.Fatalf("%d RECONFIGUREs for one outage with five LINK_DEAD events: reconnects ran in parallel", n)
	}
	if h, _ := a.Health("pvc-1"); h.Reconnects != 1 || !h.Connected {
		t.Fatalf("health after the outage: %+v", h)
	}
}

// flushOn sends a FLUSH on a socket the fake kernel holds, as the kernel
// would, and reports whether the server answered it.
func flushOn(f *os.File) bool {
	c, err := net.FileConn(f)
	if err != nil {
		return false
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(5 * time.Second))
	var req [28]byte
	(&nbd.Request{Type: nbd.CmdFlush, Handle: 7}).Encode(req[:])
	if _, err := c.Write(req[:]); err != nil {
		return false
	}
	var rep [16]byte
	if _, err := io.ReadFull(c, rep[:]); err != nil {
		return false
	}
	r, err := nbd.DecodeReply(rep[:])
	return err == nil && r.Handle == 7 && r.Errno == 0
}

// TestAdoptKeepsOneConnection: a process re-adopts a device whose old
// process died while the kernel kept its socket. When that socket is
// healthy the kernel takes none of the new ones: the attacher closes its
// unused connection and the old one goes on serving, undisturbed. When
// the kernel had a dead slot and takes the new socket, the first request
// on it supersedes (fences) the old connection of the volume's session.
// Either way the server ends with one connection per device connection.
func TestAdoptKeepsOneConnection(t *testing.T) {
	for _, healthy := range []bool{true, false} {
		t.Run(map[bool]string{true: "healthy device", false: "dead slot"}[healthy], func(t *testing.T) {
			s, addr := startServer(t)
			dir := t.TempDir()
			k := newFakeKernel()
			k.holdSockets = true
			t.Cleanup(func() {
				for _, f := range k.held {
					f.Close()
				}
			})
			d := &fakeDevices{backends: map[string]uint32{}}
			a, err := New(Config{Mode: attach.TCP, Kernel: k, Devices: d, Logger: quiet(), StateDir: dir})
			if err != nil {
				t.Fatal(err)
			}
			tg := attach.Target{VolumeID: "pvc-1", Export: "vol", Addrs: []string{addr}}
			if _, err := a.Attach(context.Background(), tg, attach.Options{}); err != nil {
				t.Fatal(err)
			}
			waitConns(t, s, 1)
			a.Close()
			d.backends["pvc-1"] = 0
			k.healthy = healthy
			b, err := New(Config{Mode: attach.TCP, Kernel: k, Devices: d, Logger: quiet(), StateDir: dir})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(b.Close)
			if _, err := b.Attach(context.Background(), tg, attach.Options{}); err != nil {
				t.Fatal(err)
			}
			k.mu.Lock()
			held := append([]*os.File(nil), k.held...)
			k.mu.Unlock()
			if healthy {
				if len(held) != 1 {
					t.Fatalf("the kernel holds %d sockets, want its first one", len(held))
				}
				waitConns(t, s, 1)
				if !flushOn(held[0]) {
					t.Fatal("the kernel's healthy connection stopped serving after the re-adoption")
				}
				if h, err := b.Health("pvc-1"); err != nil || !h.Connected {
					t.Fatalf("health of a device taken over healthy: %+v, %v", h, err)
				}
				return
			}
			if len(held) != 2 {
				t.Fatalf("the kernel holds %d sockets, want 2", len(held))
			}
			if !flushOn(held[1]) {
				t.Fatal("the socket the kernel took does not serve")
			}
			waitConns(t, s, 1)
			if flushOn(held[0]) {
				t.Fatal("the superseded connection still serves")
			}
		})
	}
}

// TestAdoptWhileServerDown: a fresh process re-adopts a device while its
// storage node is away (the plugin restarted during an outage): the
// adoption succeeds, health says the volume waits, and the device gets
// its sockets once the server is back.
func TestAdoptWhileServerDown(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	dir := t.TempDir()
	k := newFakeKernel()
	d := &fakeDevices{backends: map[string]uint32{"pvc-1": 3}}
	if err := os.WriteFile(dir+"/pvc-1.json", []byte(`{"mode":"tcp","target":{"VolumeID":"pvc-1","Export":"vol","Addrs":["`+addr+`"]}}`), 0o600); err != nil {
		t.Fatal(err)
	}
	a, err := New(Config{Mode: attach.TCP, Kernel: k, Devices: d, Logger: quiet(), StateDir: dir, DialTimeout: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(a.Close)
	atts, err := a.Adopt(context.Background())
	if err != nil || len(atts) != 1 || atts[0].Device != "/dev/nbd3" {
		t.Fatalf("adopt with the server down: %+v, %v", atts, err)
	}
	h, err := a.Health("pvc-1")
	if err != nil || h.Connected || h.Outage <= 0 {
		t.Fatalf("health while the server is away: %+v, %v", h, err)
	}
	s := serveAgain(t, addr)
	waitReconfigured(t, k)
	waitConns(t, s, 1)
	deadline := time.Now().Add(5 * time.Second)
	for {
		h, _ := a.Health("pvc-1")
		if h.Connected && h.Outage == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("health after the server came back: %+v", h)
		}
		time.Sleep(10 * time.Millisecond)
	}
	if att, _ := a.Attach(context.Background(), attach.Target{VolumeID: "pvc-1", Export: "vol", Addrs: []string{addr}}, attach.Options{}); att.Size != 1<<20 {
		t.Fatalf("attachment after the reconnect: %+v", att)
	}
}

// serveAgain serves a fresh export "vol" on addr (a server back after an
// outage), retrying while the port is still taken.
func serveAgain(t *testing.T, addr string) *nbd.Server {
	t.Helper()
	var l net.Listener
	var err error
	for i := 0; i < 50; i++ {
		if l, err = net.Listen("tcp", addr); err == nil {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	if err != nil {
		t.Fatal(err)
	}
	s := &nbd.Server{Logger: quiet()}
	if err := s.AddExport(&nbd.Export{Name: "vol", Backend: nbd.NewMemBackend(1 << 20)}); err != nil {
		t.Fatal(err)
	}
	go s.Serve(l)
	t.Cleanup(func() { s.Shutdown(context.Background()) })
	return s
}

func waitReconfigured(t *testing.T, k *fakeKernel) {
	t.Helper()
	select {
	case <-k.reconfigured:
	case <-time.After(15 * time.Second):
		t.Fatal("no RECONFIGURE after the server came back")
	}
}

// TestSupersededDisconnects: a reconnect that the server refuses as
// superseded (the volume was published to this node again since) ends
// the device: it is disconnected, which fails its I/O with EIO, instead
// of reconnecting forever; other refusals are retried (as a server that
// restarts gives them). Detach still succeeds.
func TestSupersededDisconnects(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var mode atomic.Value
	mode.Store("")
	s := &nbd.Server{Logger: quiet()}
	s.Resolve = func(_ nbd.ConnInfo, name string) (nbd.Grant, error) {
		switch mode.Load().(string) {
		case "denied":
			return nbd.Grant{}, errors.New("not published")
		case "superseded":
			return nbd.Grant{}, fmt.Errorf("epoch 3, now 5: %w", nbd.ErrSuperseded)
		}
		return nbd.Grant{Export: name}, nil
	}
	if err := s.AddExport(&nbd.Export{Name: "vol", Backend: nbd.NewMemBackend(1 << 20)}); err != nil {
		t.Fatal(err)
	}
	go s.Serve(l)
	t.Cleanup(func() { s.Shutdown(context.Background()) })
	k := newFakeKernel()
	k.linkDead = make(chan nbdnl.LinkDead, 8)
	a, err := New(Config{Mode: attach.TCP, Kernel: k, Devices: &fakeDevices{backends: map[string]uint32{}}, Logger: quiet(), DialTimeout: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(a.Close)
	tg := attach.Target{VolumeID: "pvc-1", Export: "vol", Addrs: []string{l.Addr().String()}}
	if _, err := a.Attach(context.Background(), tg, attach.Options{}); err != nil {
		t.Fatal(err)
	}
	disconnects := func() int {
		k.mu.Lock()
		defer k.mu.Unlock()
		return len(k.disconnects)
	}
	mode.Store("denied")
	k.linkDead <- nbdnl.LinkDead{Index: 0}
	for i := 0; i < 100; i++ {
		if h, _ := a.Health("pvc-1"); !h.Connected && strings.Contains(h.Message, "not published") {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	if n := disconnects(); n != 0 {
		t.Fatalf("%d disconnects after an ordinary refusal", n)
	}
	mode.Store("superseded")
	for i := 0; i < 500 && disconnects() == 0; i++ {
		time.Sleep(20 * time.Millisecond)
	}
	if n := disconnects(); n != 1 {
		t.Fatalf("%d disconnects 10 s after the server refused the export as superseded, want 1", n)
	}
	if h, _ := a.Health("pvc-1"); !strings.Contains(h.Message, "superseded") {
		t.Errorf("health after the refusal: %+v", h)
	}
	k.mu.Lock()
	n := len(k.reconfigs)
	k.mu.Unlock()
	if n != 0 {
		t.Errorf("%d RECONFIGUREs", n)
	}
	if err := a.Detach(context.Background(), "pvc-1"); err != nil {
		t.Fatalf("detach after the fence: %v", err)
	}
}

// TestMulticonnReplicatedDialsThePrimary: a replicated volume's multiconn
// connections all go to the one server that serves it, wherever the
// publication put the primary: at attach (the target's own server is a
// replica that refuses), and after a failover (LINK_DEAD with the old
// primary refusing the export: the RECONFIGURE's sockets are all the new
// primary's).
func TestMulticonnReplicatedDialsThePrimary(t *testing.T) {
	// serve is a storage node with two addresses, serving the volume or
	// refusing it (a replica that is not the primary).
	serve := func(primary bool) (*nbd.Server, []string) {
		s := &nbd.Server{Logger: quiet()}
		if primary {
			if err := s.AddExport(&nbd.Export{Name: "vol", Backend: nbd.NewMemBackend(1 << 20)}); err != nil {
				t.Fatal(err)
			}
		}
		var addrs []string
		for range 2 {
			l, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				t.Fatal(err)
			}
			go s.Serve(l)
			addrs = append(addrs, l.Addr().String())
		}
		t.Cleanup(func() { s.Shutdown(context.Background()) })
		return s, addrs
	}
	replica, replicaAddrs := serve(false)
	primary, primaryAddrs := serve(true)
	k := newFakeKernel()
	a, err := New(Config{Mode: attach.MultiConn, Kernel: k, Devices: &fakeDevices{backends: map[string]uint32{}}, Logger: quiet(), DialTimeout: 6 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(a.Close)
	tg := attach.Target{VolumeID: "pvc-1", Export: "vol", Addrs: replicaAddrs,
		Replicas: []attach.Server{{StorageNode: "store-2", Addrs: primaryAddrs}}}
	if _, err := a.Attach(context.Background(), tg, attach.Options{}); err != nil {
		t.Fatalf("attach with the primary among the replicas: %v", err)
	}
	k.mu.Lock()
	n := len(k.connects[0].Sockets)
	k.mu.Unlock()
	if n != 2 {
		t.Fatalf("CONNECT with %d sockets, want one per address of the primary (2)", n)
	}
	// Both there (the replica has no such export to hold any).
	waitConns(t, primary, 2)

	// The failover: the old primary refuses the volume, the replica serves.
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := primary.RemoveExport(ctx, "vol"); err != nil {
		t.Fatal(err)
	}
	if err := replica.AddExport(&nbd.Export{Name: "vol", Backend: nbd.NewMemBackend(1 << 20)}); err != nil {
		t.Fatal(err)
	}
	k.linkDead <- nbdnl.LinkDead{Index: 0}
	select {
	case <-k.reconfigured:
	case <-time.After(15 * time.Second):
		t.Fatal("no RECONFIGURE after LINK_DEAD")
	}
	k.mu.Lock()
	n = len(k.reconfigs[len(k.reconfigs)-1].Sockets)
	k.mu.Unlock()
	if n != 2 {
		t.Fatalf("RECONFIGURE with %d sockets, want one per address of the new primary (2)", n)
	}
	waitConns(t, replica, 2)
}
