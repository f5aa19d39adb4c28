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

package nodeattach

import (
	"bytes"
	"context"
	"crypto/rand"
	"fmt"
	"net/netip"
	"os/exec"
	"testing"
	"time"

	"github.com/mpnbd/mpnbd/pkg/attach"
)

// A storage host that loses power, or a path whose switch dies, sends no
// reset: its peers see silence, and TCP retransmits into it for
// tcp_retries2 (about 15 minutes) before it gives up. These tests make
// that silence on the real kernel nbd driver: netem drops every packet
// of a path, both ways, while fio writes and verifies the raw device.
// They measure the stall (the longest time without a completed I/O) and
// print it.

// silentTimes are how long a path stays silent and how long the whole
// storage host does: seconds in the suite, minutes with MPNBD_SOAK=1.
func silentTimes() (path, host time.Duration) {
	if soak() {
		return time.Minute, 2 * time.Minute
	}
	return 8 * time.Second, 20 * time.Second
}

// Bounds of the stalls, far below the kernel's own tcp_retries2 (about 15
// minutes) and with room for a loaded TCG guest.
const (
	// relayPathStall bounds the stall of the relay when one path of its
	// MPTCP connection falls silent: MPTCP moves the data to the others.
	relayPathStall = 8 * time.Second
	// deadPeerNotice bounds how long the relay takes to notice a silent
	// storage host: the dead-peer bound and some slack.
	deadPeerNotice = attach.DefaultDeadPeerTimeout + 7*time.Second
	// resumeLimit bounds the time from the host's return to the next
	// completed I/O: a redial (the relay's backoff caps at 5 s) and a
	// replay.
	resumeLimit = 15 * time.Second
	// multiconnStall bounds the stall of multiconn when one path falls
	// silent: the kernel requeues the silent socket's requests on the
	// others once their request timeout passes.
	multiconnStall = 30 * time.Second
)

// TestTransportsSilentPath writes and verifies the raw device with fio
// while storage paths fall silent (their packets dropped both ways, no
// reset, no link down), on the transports that bound that wait
// themselves. relay: one path of its MPTCP connection is silenced and
// restored (MPTCP carries on over the others within seconds, nothing is
// redialed), then the whole storage host (every path) for 20 s: the
// relay must notice within seconds, not after tcp_retries2, and I/O must
// resume once the host is back. multiconn: the path carrying the I/O is
// silenced; the kernel requeues its requests on the other sockets, and
// the silent socket dies of its TCP_USER_TIMEOUT, at both ends, before
// the path returns, so that nothing queued on it can reach the server
// late, over newer writes. Every round must verify and the device must
// read back the server's file; the stalls are measured and printed.
func TestTransportsSilentPath(t *testing.T) {
	requireGuest(t)
	if _, err := exec.LookPath("fio"); err != nil {
		t.Skipf("fio is not in the VM (the host test copies it from the host, which lacks it: install the Debian package fio): %v", err)
	}
	// The fault tests wait out outages, stalls and timeouts side by side.
	t.Parallel()
	t.Run("relay", func(t *testing.T) {
		t.Parallel()
		silentRelay(t)
	})
	t.Run("multiconn", func(t *testing.T) {
		t.Parallel()
		silentMulticonn(t)
	})
}

// silentRelay is TestTransportsSilentPath for the relay transport.
func silentRelay(t *testing.T) {
	pathFor, hostFor := silentTimes()
	tp := guestTopology(t)
	srv := startOurServer(t, tp, faultExportSize)
	a, _ := newAttacher(t, tp, attach.Relay)
	tg := srv.target(volID(t))
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	att, err := a.Attach(ctx, tg, attach.Options{})
	cancel()
	if err != nil {
		t.Fatalf("attach relay: %v", err)
	}
	t.Cleanup(func() {
		if err := a.Detach(context.Background(), tg.VolumeID); err != nil {
			t.Errorf("detach: %v", err)
		}
	})
	stuck := attacherStuck(t, a, tg, att.Device)
	// The relay's own connection is MPTCP: wait (bounded) for a subflow
	// on every path, or a silent path would cost nothing to begin with.
	var h attach.Health
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(200 * time.Millisecond) {
		h, _ = a.Health(tg.VolumeID)
		if len(h.Subflows) == 1 && h.Subflows[0] == len(tp.Paths) || time.Now().After(deadline) {
			break
		}
	}
	if !h.MPTCP || len(h.Subflows) != 1 || h.Subflows[0] != len(tp.Paths) {
		t.Fatalf("the relay's connection has subflows %v (MPTCP: %v) after 30 s, want one on each of the %d paths", h.Subflows, h.MPTCP, len(tp.Paths))
	}
	t.Logf("relay attached as %s over one MPTCP connection with %d subflows", att.Device, h.Subflows[0])

	w := watchIO(t, att.Device)
	type faultTimes struct {
		path                 int
		pathCut, pathBack    time.Time
		hostCut, hostBack    time.Time
		hostRestoring        time.Time
		noticed              time.Duration // zero: never
		reconnectsAfterPath  int
		reconnectsBeforeHost int
		healthAtEndOfSilence attach.Health
		healthNoticedSilence attach.Health
	}
	var ft faultTimes
	done := make(chan struct{})
	// The faults run beside the fio rounds, each once the device is busy.
	go func() {
		defer close(done)
		busy := func() bool {
			base, since := writeIOs(att.Device), time.Now()
			for writeIOs(att.Device)-base < 64 {
				if time.Since(since) > time.Minute {
					t.Errorf("the device completed %d writes in a minute, fewer than 64", writeIOs(att.Device)-base)
					return false
				}
				time.Sleep(20 * time.Millisecond)
			}
			return true
		}
		if !busy() {
			return
		}
		before, _ := a.Health(tg.VolumeID)
		ft.path = busiestPath(t, tp, time.Second)
		ft.pathCut = time.Now()
		if err := silencePaths(tp, ft.path); err != nil {
			t.Error(err)
			return
		}
		t.Logf("path %d silent for %v", ft.path, pathFor)
		time.Sleep(pathFor)
		if err := restorePaths(tp, ft.path); err != nil {
			t.Error(err)
			return
		}
		ft.pathBack = time.Now()
		after, _ := a.Health(tg.VolumeID)
		ft.reconnectsAfterPath = after.Reconnects - before.Reconnects
		if !busy() {
			return
		}
		ft.reconnectsBeforeHost = after.Reconnects
		ft.hostCut = time.Now()
		if err := silencePaths(tp, allPaths(tp)...); err != nil {
			t.Error(err)
			return
		}
		t.Logf("the storage host silent (all %d paths) for %v", len(tp.Paths), hostFor)
		for time.Since(ft.hostCut) < hostFor {
			h, _ := a.Health(tg.VolumeID)
			if ft.noticed == 0 && !h.Connected {
				ft.noticed = time.Since(ft.hostCut)
				ft.healthNoticedSilence = h
			}
			time.Sleep(100 * time.Millisecond)
		}
		ft.healthAtEndOfSilence, _ = a.Health(tg.VolumeID)
		ft.hostRestoring = time.Now()
		if err := restorePaths(tp, allPaths(tp)...); err != nil {
			t.Error(err)
			return
		}
		ft.hostBack = time.Now()
	}()
	// Make sure the restore runs even if the test ends early.
	t.Cleanup(func() { <-done; _ = restorePaths(tp, allPaths(tp)...) })

	// Rounds back to back while the faults run; the one running when
	// they end must finish too: I/O resumed.
	seed := int(time.Now().UnixNano()%1000000) + 13
	rounds := 0
	for finished := false; !finished; {
		rounds++
		seed++
		res := startFio(t, att.Device, seed).wait(t, roundLimit, stuck)
		t.Logf("round %d: %v", rounds, res)
		if !res.ok() {
			t.Fatalf("round %d with storage paths falling silent: %v\n%s", rounds, res, tail(res.output, 40))
		}
		select {
		case <-done:
			finished = true
		default:
		}
	}
	if t.Failed() || ft.hostBack.IsZero() {
		t.FailNow()
	}
	end := time.Now()
	pathStall, pathStallAt := w.stall(ft.pathCut, ft.pathBack)
	hostStall, hostStallAt := w.stall(ft.hostCut, end)
	resumed, ok := w.firstAfter(ft.hostRestoring)
	if !ok {
		t.Fatalf("no I/O completed after the storage host came back, though fio finished")
	}
	h, _ = a.Health(tg.VolumeID)
	t.Logf("relay: %d rounds verified; health %+v", rounds, h)
	t.Logf("relay: STALL path %d silent for %v (%v with the tc commands): longest stall %v (from %v after the cut); reconnects meanwhile: %d",
		ft.path, pathFor, ft.pathBack.Sub(ft.pathCut).Round(time.Millisecond), pathStall.Round(time.Millisecond), pathStallAt.Sub(ft.pathCut).Round(time.Millisecond), ft.reconnectsAfterPath)
	noticed := "never noticed"
	if ft.noticed != 0 {
		noticed = fmt.Sprintf("noticed after %v (health then %+v)", ft.noticed.Round(time.Millisecond), ft.healthNoticedSilence)
	}
	t.Logf("relay: STALL storage host silent for %v (%v with the tc commands): %s, I/O resumed %v after the host began to come back (the restore took %v), longest stall %v (from %v after the cut)",
		hostFor, ft.hostBack.Sub(ft.hostCut).Round(time.Millisecond), noticed, resumed.Sub(ft.hostRestoring).Round(time.Millisecond), ft.hostBack.Sub(ft.hostRestoring).Round(time.Millisecond),
		hostStall.Round(time.Millisecond), hostStallAt.Sub(ft.hostCut).Round(time.Millisecond))
	if pathStall > relayPathStall {
		t.Errorf("one silent path of %d stalled the relay's I/O for %v, more than %v: MPTCP should carry on over the other paths", len(tp.Paths), pathStall, relayPathStall)
	}
	if ft.reconnectsAfterPath != 0 {
		t.Errorf("one silent path of %d made the relay redial %d times: a connection with live subflows is not dead", len(tp.Paths), ft.reconnectsAfterPath)
	}
	switch {
	case ft.noticed == 0:
		t.Errorf("the relay did not notice in %v that the storage host went silent (health at the end: %+v): it waits for tcp_retries2, about 15 minutes", hostFor, ft.healthAtEndOfSilence)
	case ft.noticed > deadPeerNotice:
		t.Errorf("the relay noticed the silent storage host after %v, more than %v", ft.noticed, deadPeerNotice)
	}
	if d := resumed.Sub(ft.hostRestoring); d > resumeLimit {
		t.Errorf("I/O resumed %v after the storage host came back, more than %v", d, resumeLimit)
	}
	if h.Reconnects <= ft.reconnectsBeforeHost {
		t.Errorf("no redial recorded across the silent storage host (reconnects %d before, %d after)", ft.reconnectsBeforeHost, h.Reconnects)
	}
	compareWithImage(t, srv.image, att.Device, stuck)
}

// silentMulticonn is TestTransportsSilentPath for the multiconn
// transport.
func silentMulticonn(t *testing.T) {
	tp := plainGuestTopology(t)
	srv := startOurServer(t, tp, faultExportSize)
	a, _ := newAttacher(t, tp, attach.MultiConn)
	tg := srv.target(volID(t))
	// The kernel requeues a silent socket's requests only when their
	// request timeout passes (a socket that dies does not requeue what
	// it carried), so that timeout is the stall: 15 s here, half the
	// default. The driver allows down to twice the dead-peer bound, but
	// a loaded TCG guest sometimes takes 10 s over a request.
	opts := attach.Options{RequestTimeout: 15 * time.Second}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	att, err := a.Attach(ctx, tg, opts)
	cancel()
	if err != nil {
		t.Fatalf("attach multiconn: %v", err)
	}
	t.Cleanup(func() {
		if err := a.Detach(context.Background(), tg.VolumeID); err != nil {
			t.Errorf("detach: %v", err)
		}
	})
	stuck := attacherStuck(t, a, tg, att.Device)
	if n := srv.clients(); n != len(tp.Paths) {
		t.Fatalf("multiconn: the server serves %d connections, want one per path (%d)", n, len(tp.Paths))
	}
	w := watchIO(t, att.Device)
	seed := int(time.Now().UnixNano()%1000000) + 17
	start := func() *fioRun { seed++; return startFio(t, att.Device, seed) }
	// Round 1 runs into the silence: cut the path that carries its I/O,
	// once the device has one socket on it (a request timeout that fires
	// on a loaded guest replaces a socket, and for a moment the old one
	// and its successor are both there).
	f := midWrite(t, start(), att.Device, 256, start, stuck)
	var p int
	var oldConn tcpConn
	for deadline := time.Now().Add(30 * time.Second); ; {
		p = busiestPath(t, tp, 500*time.Millisecond)
		if !f.running() {
			f = midWrite(t, f, att.Device, 64, start, stuck)
		}
		serverEnd := netip.AddrPortFrom(tp.ServerAddr(p), ourServerPort)
		all, err := tcpSocketsOf("self")
		if err != nil {
			t.Fatal(err)
		}
		var on []tcpConn
		for _, c := range all {
			if c.local.Addr() == tp.ClientAddr(p) && c.remote == serverEnd && c.state != "06" {
				on = append(on, c)
			}
		}
		if len(on) == 1 && on[0].state == "01" {
			oldConn = on[0]
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the device's sockets on path %d: %v after 30 s, want one, established", p, on)
		}
		t.Logf("the device's sockets on path %d: %v; waiting for one", p, on)
		time.Sleep(500 * time.Millisecond)
	}
	spid := srv.pid()

	cut := time.Now()
	if err := silencePaths(tp, p); err != nil {
		t.Fatal(err)
	}
	restored := false
	defer func() {
		if !restored {
			_ = restorePaths(tp, p)
		}
	}()
	ends := trackEnds(t, oldConn, spid)
	t.Logf("path %d (the device's socket %v) silent; request timeout %v, dead-peer bound %v", p, oldConn, opts.KernelRequestTimeout(), opts.EffectiveDeadPeerTimeout())
	res := f.wait(t, roundLimit, stuck)
	if !res.ok() {
		t.Fatalf("fio round with path %d falling silent: %v\n%s", p, res, tail(res.output, 40))
	}
	stall, stallAt := w.stall(cut, time.Now())
	t.Logf("multiconn: STALL path %d silent: longest stall %v (from %v after the cut); round: %v",
		p, stall.Round(time.Millisecond), stallAt.Sub(cut).Round(time.Millisecond), res)
	if stall > multiconnStall {
		t.Errorf("one silent path of %d stalled multiconn's I/O for %v, more than %v", len(tp.Paths), stall, multiconnStall)
	}
	// With MPNBD_SOAK=1 more rounds run without the path for a minute.
	pathFor, _ := silentTimes()
	for soak() && time.Since(cut) < pathFor {
		res := start().wait(t, roundLimit, stuck)
		if !res.ok() {
			t.Fatalf("fio round with path %d silent: %v\n%s", p, res, tail(res.output, 40))
		}
		t.Logf("round with path %d silent: %v", p, res)
	}
	// Newer data, flushed, over every block, the ones round 1's writes
	// stuck on the silent socket included, still without path p.
	newer := make([]byte, fioSize)
	rand.Read(newer)
	wrote := make(chan error, 1)
	go func() { wrote <- writeDevice(att.Device, newer) }()
	select {
	case err := <-wrote:
		if err != nil {
			t.Fatalf("write newer data with path %d silent: %v", p, err)
		}
	case <-time.After(2 * time.Minute):
		stuck("writing newer data did not finish within 2m")
		t.FailNow()
	}
	image, err := readImage(srv.image)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(image, newer) {
		t.Fatalf("the server's file does not hold the newer data written and flushed through %s", att.Device)
	}

	// Before the path returns, its old connection must be gone at both
	// ends: the device's socket died of TCP_USER_TIMEOUT, purging the
	// requests it had not delivered, and the server ended its side. A
	// socket still open would deliver them when the path returns.
	clientGone, serverGone := ends.wait(cut.Add(opts.KernelRequestTimeout() + 20*time.Second))
	switch {
	case clientGone == 0 || serverGone == 0:
		left := func(d time.Duration, pid string, c tcpConn) string {
			if d != 0 {
				return fmt.Sprintf("gone after %v", d.Round(time.Millisecond))
			}
			return fmt.Sprint(socketsOf(t, pid, c.local, c.remote))
		}
		t.Errorf("path %d's old connection is still open %v after the path fell silent (the device's end: %s; the server's: %s): what it holds can reach the server when the path returns, after newer writes",
			p, time.Since(cut).Round(time.Millisecond), left(clientGone, "self", oldConn), left(serverGone, spid, tcpConn{local: oldConn.remote, remote: oldConn.local}))
	default:
		t.Logf("multiconn: path %d's old connection: the device's end gone %v after the cut, the server's %v", p, clientGone.Round(time.Millisecond), serverGone.Round(time.Millisecond))
	}
	if err := restorePaths(tp, p); err != nil {
		t.Fatal(err)
	}
	restored = true
	back := time.Now()
	// No I/O is issued now, so the server's file must keep the newer
	// data until the old connection is gone at both ends (at once, where
	// it died during the silence; a late delivery would come with its
	// next retransmission).
	for deadline := back.Add(40 * time.Second); ; time.Sleep(200 * time.Millisecond) {
		now, err := readImage(srv.image)
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(now, image) {
			t.Fatalf("the server's file changed %v after path %d came back, with no I/O issued: a write queued on the silent path landed late, over newer flushed data", time.Since(back).Round(time.Millisecond), p)
		}
		cl := socketsOf(t, "self", oldConn.local, oldConn.remote)
		sl := socketsOf(t, spid, oldConn.remote, oldConn.local)
		if len(cl) == 0 && len(sl) == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("path %d's old connection still open 40 s after the path came back (the device's end: %v; the server's: %v)", p, cl, sl)
		}
	}
	h, _ := a.Health(tg.VolumeID)
	t.Logf("multiconn: after path %d came back: %d server connections; health %+v", p, srv.clients(), h)
	compareWithImage(t, srv.image, att.Device, stuck)
}
