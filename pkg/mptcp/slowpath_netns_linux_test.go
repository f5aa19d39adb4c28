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

package mptcp_test

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/netip"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/mpnbd/mpnbd/internal/testenv/syncbuf"
	"github.com/mpnbd/mpnbd/internal/testenv/topo"
	"github.com/mpnbd/mpnbd/pkg/mptcp"
)

// TestKeepFlagsSlowPath runs Keep with the slow-path watch on the sending
// host of an MPTCP connection over 3 x 200 Mbit/s + 20 Mbit/s while data
// flows: the 20 Mbit/s path's endpoint gets the backup flag and its
// subflow turns backup; then the path is shaped to 200 Mbit/s like the
// others, and the flag goes and the path carries data again. The paths
// run at a fifth of the field's 1 Gbit/s: the ratios the watch decides by
// are the same, and a host whose two cores the rest of the suite shares
// still moves 620 Mbit/s with CPU to spare, so the shapers decide each
// path's rate (at 3.1 Gbit/s the CPU did, and a recovered path that the
// scheduler had no CPU to fill looked slow again). "reads" is
// the storage server's side (it sends, signal endpoints), "writes" the
// node's (subflow endpoints).
// TestKeepFlagsSlowPath: on the sending host, Keep (or, in place,
// FlagInPlace over the kernel's implicit endpoints of a client that only
// joins what the server announces) flags the slow path's endpoint backup,
// keeps it flagged while it stays slow, and clears the flag once it
// recovers.
func TestKeepFlagsSlowPath(t *testing.T) {
	for _, side := range []string{"reads", "writes", "writes-in-place"} {
		t.Run(side, func(t *testing.T) { testKeepFlagsSlowPath(t, side == "reads", side == "writes-in-place") })
	}
}

// slowPathScale divides the rates of the asymmetric topology in
// TestKeepFlagsSlowPath.
const slowPathScale = 5

func testKeepFlagsSlowPath(t *testing.T, serverSends, inPlace bool) {
	cfg := topo.Asymmetric(topo.UniqueName("sp"))
	for i := range cfg.Paths {
		cfg.Paths[i].RateMbit /= slowPathScale
	}
	tp := topo.NewForTest(t, cfg)
	if err := mptcp.Available(); err != nil {
		t.Skipf("skipping: MPTCP unavailable: %v", err)
	}
	client, server := connectAllPaths(t, tp)
	sender, receiver := client, server
	senderNS, inSender := tp.ClientNS, tp.InClient
	d := mptcp.Desired{Role: mptcp.RoleClient}
	for i := range tp.Paths {
		d.NICs = append(d.NICs, mptcp.NICSpec(netip.PrefixFrom(tp.ClientAddr(i+1), 32).String()))
	}
	slowAddr := tp.ClientAddr(4)
	if serverSends {
		sender, receiver = server, client
		senderNS, inSender = tp.ServerNS, tp.InServer
		// The server's signal endpoints are those of paths 2..4, as the
		// topology made them.
		d = mptcp.Desired{Role: mptcp.RoleServer, Port: uint16(tp.JoinPort)}
		for i := 2; i <= len(tp.Paths); i++ {
			d.NICs = append(d.NICs, mptcp.NICSpec(netip.PrefixFrom(tp.ServerAddr(i), 32).String()))
		}
		slowAddr = tp.ServerAddr(4)
	}

	ctx, cancel := context.WithCancel(context.Background())
	kept := make(chan error, 1)
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-kept:
			if err != nil {
				t.Errorf("Keep: %v", err)
			}
		case <-time.After(10 * time.Second):
			t.Error("Keep did not return 10 s after its context ended")
		}
	})
	log := slog.New(slog.NewTextHandler(tWriter{t}, nil))
	policy := &mptcp.SlowPathPolicy{ProbeAfter: 2 * time.Second}
	go func() {
		kept <- inSender(func() error {
			if inPlace {
				var addrs []netip.Addr
				for i := range tp.Paths {
					addrs = append(addrs, tp.ClientAddr(i+1))
				}
				return mptcp.FlagInPlace(ctx, addrs, *policy, log)
			}
			return mptcp.Keep(ctx, d, log, policy)
		})
	}()

	// The sender writes as fast as it can, the receiver discards.
	go func() { _, _ = io.Copy(io.Discard, receiver) }()
	go func() {
		buf := make([]byte, 1<<20)
		for ctx.Err() == nil {
			if _, err := sender.Write(buf); err != nil {
				return
			}
		}
	}()

	var pm *mptcp.PM
	var diag *mptcp.SocketDiag
	if err := inSender(func() error {
		var err error
		if pm, err = mptcp.DialPM(); err != nil {
			return err
		}
		diag, err = mptcp.DialSocketDiag()
		return err
	}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pm.Close(); diag.Close() })
	flagged := func() map[netip.Addr]bool {
		eps, err := pm.Endpoints()
		if err != nil {
			t.Fatalf("endpoints in %s: %v", senderNS, err)
		}
		m := map[netip.Addr]bool{}
		for _, e := range eps {
			if e.Flags&mptcp.Backup != 0 {
				m[e.Addr] = true
			}
		}
		return m
	}
	// subflow is the subflow from a; a missing one (the endpoints are
	// being set up, and the kernel makes it again) is for the waits to
	// report, bounded.
	subflow := func(a netip.Addr) (mptcp.TCPSocket, string) {
		socks, err := diag.Established()
		if err != nil {
			t.Fatal(err)
		}
		for _, s := range socks {
			if s.Subflow && s.Local.Addr() == a {
				return s, ""
			}
		}
		return mptcp.TCPSocket{}, fmt.Sprintf("no subflow from %s in %s: %+v", a, senderNS, socks)
	}

	// Slow: flagged within 20 s (three slow samples SlowPathInterval apart,
	// once the windows have grown), the others left alone.
	start := time.Now()
	waitFor(t, 20*time.Second, "the slow path's endpoint flagged backup", func() string {
		f := flagged()
		s, missing := subflow(slowAddr)
		if missing != "" {
			return missing
		}
		if f[slowAddr] && len(f) == 1 && s.BackupLocal {
			return ""
		}
		return fmt.Sprintf("flagged %v, subflow %+v", f, s)
	})
	t.Logf("path 4 (%s) flagged backup %v after the data started", slowAddr, time.Since(start).Round(100*time.Millisecond))

	// It stays flagged while slow: Keep measures it beside the
	// connection (ICMP echo, every ProbeAfter), so the flag is never
	// cleared to probe it, and its subflow carries next to nothing (in
	// use, it would carry 2.5 MB/s; what it had queued when flagged
	// drains in the first second).
	time.Sleep(time.Second)
	s, _ := subflow(slowAddr)
	for end := time.Now().Add(3 * policy.ProbeAfter); time.Now().Before(end); time.Sleep(50 * time.Millisecond) {
		if !flagged()[slowAddr] {
			t.Fatal("the still slow path's flag was cleared: a probe put the connection's data on it")
		}
	}
	if s2, missing := subflow(slowAddr); missing == "" && s2.Cookie == s.Cookie && s2.BytesAcked-s.BytesAcked > 4<<20 {
		t.Errorf("the flagged path's subflow carried %d bytes while it was measured aside", s2.BytesAcked-s.BytesAcked)
	}

	// Recovered: shaped like the others, the flag goes at the next
	// measure (ProbeAfter away) and the path carries data.
	if err := tp.SetRate(4, cfg.Paths[0].RateMbit); err != nil {
		t.Fatal(err)
	}
	start = time.Now()
	waitFor(t, 15*time.Second, "the recovered path's flag cleared and data on it", func() string {
		b, missing := subflow(slowAddr)
		if missing != "" {
			return missing
		}
		before := b.BytesAcked
		if flagged()[slowAddr] {
			return "still flagged"
		}
		time.Sleep(time.Second)
		s, missing := subflow(slowAddr)
		if missing != "" {
			return missing
		}
		if s.Cookie != b.Cookie {
			return "the subflow was replaced meanwhile"
		}
		if s.BackupLocal || s.BytesAcked-before < 4<<20 {
			return fmt.Sprintf("subflow %+v, %d bytes in a second", s, s.BytesAcked-before)
		}
		return ""
	})
	t.Logf("path 4 in use again %v after it recovered", time.Since(start).Round(100*time.Millisecond))
	for range 3 {
		time.Sleep(time.Second)
		if flagged()[slowAddr] {
			t.Fatal("the recovered path was flagged again")
		}
	}
}

// connectAllPaths connects an MPTCP client to a server over tp and waits
// for a subflow on every path.
func connectAllPaths(t *testing.T, tp *topo.Topology) (client, server net.Conn) {
	t.Helper()
	var ln net.Listener
	if err := tp.InServer(func() error {
		var err error
		ln, err = mptcp.Listen(context.Background(), "tcp4", net.JoinHostPort(tp.ServerAddr(1).String(), "0"), true)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	accepted := make(chan net.Conn, 1)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			t.Errorf("accept: %v", err)
		}
		accepted <- c
	}()
	if err := tp.InClient(func() error {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		var err error
		client, err = mptcp.Dialer(true).DialContext(ctx, "tcp4", ln.Addr().String())
		return err
	}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { client.Close() })
	select {
	case server = <-accepted:
	case <-time.After(10 * time.Second):
		t.Fatal("no connection accepted in 10 s")
	}
	if server == nil {
		t.FailNow()
	}
	t.Cleanup(func() { server.Close() })
	waitFor(t, 10*time.Second, fmt.Sprintf("%d subflows", len(tp.Paths)), func() string {
		subs, err := mptcp.GetSubflows(client)
		if err != nil {
			t.Fatal(err)
		}
		if len(subs) == len(tp.Paths) {
			return ""
		}
		return fmt.Sprintf("%d subflows", len(subs))
	})
	return client, server
}

// waitFor polls check until it returns "" or d has passed, then fails
// with what check last said.
func waitFor(t *testing.T, d time.Duration, what string, check func() string) {
	t.Helper()
	deadline := time.Now().Add(d)
	for {
		msg := check()
		if msg == "" {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: not after %v: %s", what, d, msg)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// tWriter sends log lines to the test's log.
type tWriter struct{ t *testing.T }

func (w tWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimSuffix(string(p), "\n"))
	return len(p), nil
}

// TestSlowPathFlaggedCarriesDataWhenOthersCut: once the slow path is
// flagged backup, the fast paths are cut (their client links down) in the
// middle of a transfer; the flagged path carries the rest, and what the
// receiver got is exactly what was sent (length and SHA-256). The watch
// measures the flagged path aside every second throughout: before the
// cut it finds it still slow, during it the path carries the data and is
// left alone (no probe floods the one path left), and it stays flagged.
func TestSlowPathFlaggedCarriesDataWhenOthersCut(t *testing.T) {
	tp := topo.NewForTest(t, topo.Asymmetric(topo.UniqueName("sc")))
	if err := mptcp.Available(); err != nil {
		t.Skipf("skipping: MPTCP unavailable: %v", err)
	}
	client, server := connectAllPaths(t, tp)
	d := mptcp.Desired{Role: mptcp.RoleClient}
	for i := range tp.Paths {
		d.NICs = append(d.NICs, mptcp.NICSpec(netip.PrefixFrom(tp.ClientAddr(i+1), 32).String()))
	}
	var watchLog syncbuf.Buffer
	ctx, cancel := context.WithCancel(context.Background())
	kept := make(chan error, 1)
	go func() {
		kept <- tp.InClient(func() error {
			return mptcp.Keep(ctx, d, slog.New(slog.NewTextHandler(io.MultiWriter(tWriter{t}, &watchLog), &slog.HandlerOptions{Level: slog.LevelDebug})), &mptcp.SlowPathPolicy{ProbeAfter: time.Second})
		})
	}()
	t.Cleanup(func() {
		cancel()
		if err := <-kept; err != nil {
			t.Errorf("Keep: %v", err)
		}
	})

	// Warm up until path 4 is flagged.
	received := make(chan struct {
		n   int64
		sum [32]byte
		err error
	}, 1)
	go func() {
		h := sha256.New()
		n, err := io.Copy(h, server)
		var s [32]byte
		copy(s[:], h.Sum(nil))
		received <- struct {
			n   int64
			sum [32]byte
			err error
		}{n, s, err}
	}()
	sent := sha256.New()
	var total int64
	block := make([]byte, 1<<20)
	write := func() {
		if _, err := rand.Read(block); err != nil {
			t.Fatal(err)
		}
		if _, err := client.Write(block); err != nil {
			t.Fatalf("write after %d bytes: %v", total, err)
		}
		sent.Write(block)
		total += int64(len(block))
	}
	flagged := time.Now().Add(30 * time.Second)
	for {
		write()
		socks, err := func() ([]mptcp.TCPSocket, error) {
			var out []mptcp.TCPSocket
			err := tp.InClient(func() error {
				dg, err := mptcp.DialSocketDiag()
				if err != nil {
					return err
				}
				defer dg.Close()
				out, err = dg.Established()
				return err
			})
			return out, err
		}()
		if err != nil {
			t.Fatal(err)
		}
		if slices.ContainsFunc(socks, func(s mptcp.TCPSocket) bool {
			return s.Subflow && s.Local.Addr() == tp.ClientAddr(4) && s.BackupLocal
		}) {
			break
		}
		if time.Now().After(flagged) {
			t.Fatal("path 4 not flagged backup within 30 s")
		}
	}
	t.Logf("path 4 flagged after %d MiB; cutting paths 1-3", total>>20)
	for p := 1; p <= 3; p++ {
		if err := topo.Exec(tp.ClientNS, "ip", "link", "set", "dev", tp.Paths[p-1].ClientIf, "down").Run(); err != nil {
			t.Fatal(err)
		}
	}
	// 48 MiB more (several seconds of measures), over the backup path
	// alone (100 Mbit/s), bounded.
	done := make(chan struct{})
	go func() {
		defer close(done)
		for range 48 {
			write()
		}
	}()
	select {
	case <-done:
	case <-time.After(90 * time.Second):
		t.Fatalf("48 MiB not written over the backup path in 90 s (%d MiB in all)", total>>20)
	}
	if err := client.(interface{ CloseWrite() error }).CloseWrite(); err != nil {
		t.Fatal(err)
	}
	select {
	case r := <-received:
		if r.err != nil || r.n != total || r.sum != [32]byte(sent.Sum(nil)) {
			t.Fatalf("received %d bytes (err %v), sent %d; checksums equal: %v", r.n, r.err, total, r.sum == [32]byte(sent.Sum(nil)))
		}
	case <-time.After(60 * time.Second):
		t.Fatal("the receiver did not get the end of the stream in 60 s")
	}
	t.Logf("%d MiB sent and received intact, the last 48 MiB over the flagged path alone", total>>20)
	log := watchLog.String()
	if !strings.Contains(log, "measured_aside=true") {
		t.Error("the watch never measured the flagged path aside")
	}
	for _, bad := range []string{"slow path recovered", "backup flag cleared"} {
		if strings.Contains(log, bad) {
			t.Errorf("the watch logged %q: the slow path was let back in or probed with data", bad)
		}
	}
}
