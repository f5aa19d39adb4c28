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
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/mpnbd/mpnbd/pkg/attach"
	"github.com/mpnbd/mpnbd/pkg/datapath"
	"github.com/mpnbd/mpnbd/pkg/ublk"
)

// handoverModes are the transports the datapath handover runs with in
// this guest: the kernel's own where its nbd takes MPTCP, ublk where the
// kernel has it, the relay (and a kernel-socket transport) elsewhere.
func handoverModes() []attach.Transport {
	switch {
	case os.Getenv(envMPTCPKernel) == "1":
		return []attach.Transport{attach.Kernel, attach.Ublk, attach.Relay}
	case ublk.Available() == nil:
		return []attach.Transport{attach.Ublk}
	}
	return []attach.Transport{attach.Relay, attach.TCP}
}

// TestDatapathHandover: a planned upgrade of the datapath component. A
// datapath process serves a volume while fio writes and verifies on it; a
// second one starts beside it and takes the volume over (the relay's end
// of the kernel's socket over SCM_RIGHTS; ublk through the driver's
// recovery; the kernel's sockets stay), then the first is SIGKILLed, as
// the pod deletion that follows a surge would; a third takes over from
// the second the same way. fio must end without an error or a verify
// failure, the device must read back the server's file, and the last
// process must report the volume connected and detach it.
func TestDatapathHandover(t *testing.T) {
	requireGuest(t)
	requireFaultTools(t)
	for _, mode := range handoverModes() {
		t.Run(string(mode), func(t *testing.T) {
			if mode == attach.Ublk && ublk.Available() != nil {
				t.Skipf("no ublk: %v", ublk.Available())
			}
			tp := guestTopology(t)
			st := newStorage(t, tp, faultExportSize, mode != attach.TCP)
			state := t.TempDir()
			cs := childSpec{Target: st.target(volID(t)), StateDir: state, Mode: mode,
				Datapath: filepath.Join(state, "datapath.sock")}
			prev, dev, taken := startChildTaken(t, cs)
			if taken != 0 {
				t.Fatalf("the first datapath took %d volumes over, want 0", taken)
			}
			before := writeIOs(dev)
			f := startFio(t, dev, int(time.Now().UnixNano()%1000000)+5)
			stuck := func(what string) { reportStuck(t, dev, what, "(served by a datapath process)") }
			for round := 1; round <= 2; round++ {
				// The handover must meet a writer.
				f = midWrite(t, f, dev, 128, func() *fioRun { return startFio(t, dev, int(time.Now().UnixNano()%1000000)+5+round) }, stuck)
				next, dev2, taken := startChildTaken(t, cs)
				if taken != 1 || dev2 != dev {
					t.Fatalf("round %d: the new datapath took %d volumes, device %s; want 1, %s", round, taken, dev2, dev)
				}
				// The predecessor is idle now: what a pod deletion does to it
				// must not reach the volume.
				prev.Process.Kill()
				prev.Wait()
				t.Logf("round %d: handed over after %d writes, predecessor SIGKILLed", round, writeIOs(dev)-before)
				time.Sleep(time.Second) // fio may end meanwhile: its result is checked next
				prev, before = next, writeIOs(dev)
			}
			res := f.wait(t, roundLimit, stuck)
			if !res.ok() {
				t.Fatalf("fio across two handovers: %v\n%s", res, tail(res.output, 40))
			}
			t.Logf("fio across two handovers: %v", res)
			compareWithImage(t, st.path, dev, stuck)
			healthyDetach(t, cs, mode)
			waitServerConns(t, st, 0)
			if _, err := os.Stat(dev); err == nil && mode == attach.Ublk {
				t.Fatalf("%s still exists after the detach", dev)
			}
		})
	}
}

// healthyDetach checks that the datapath serving cs's socket reports the
// volume connected over mode, and detaches it through that datapath.
func healthyDetach(t *testing.T, cs childSpec, mode attach.Transport) {
	t.Helper()
	c := &datapath.Client{Path: cs.Datapath}
	tr, h, err := c.Health(cs.Target.VolumeID)
	if err != nil || tr != mode || !h.Connected {
		t.Fatalf("health from the serving datapath: %s %+v %v", tr, h, err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := c.Detach(ctx, cs.Target.VolumeID); err != nil {
		t.Fatalf("detach through the serving datapath: %v", err)
	}
}

// TestDatapathHandoverDuringOutage: a planned upgrade meets a storage
// outage. Debian's nbd-server is SIGKILLed under fio and a successor
// datapath starts while it is down. Where the volume's data passes
// through the datapath (relay, ublk), the predecessor cannot quiesce it
// (what it took is unanswered, what it acknowledged unflushed), so it
// keeps serving it and the successor waits, not ready, instead of adopting
// it beside a live predecessor; once the server is back the volume moves
// and the predecessor is SIGKILLed. Where the kernel holds the
// connections and the I/O (tcp, kernel), the datapath only redials: the
// volume moves at once, the predecessor is SIGKILLed in the outage, and
// the successor alone brings the device back. Either way fio ends with
// no error, every block verifies, and the device reads back the server's
// file.
func TestDatapathHandoverDuringOutage(t *testing.T) {
	requireGuest(t)
	requireFaultTools(t)
	outage := 15 * time.Second
	for _, mode := range handoverModes() {
		t.Run(string(mode), func(t *testing.T) {
			if mode == attach.Ublk && ublk.Available() != nil {
				t.Skipf("no ublk: %v", ublk.Available())
			}
			tp := guestTopology(t)
			srv := startDebianServer(t, tp, faultExportSize)
			state := t.TempDir()
			cs := childSpec{Target: srv.target(volID(t)), StateDir: state, Mode: mode,
				Datapath: filepath.Join(state, "datapath.sock")}
			prev, dev, _ := startChildTaken(t, cs)
			stuck := func(what string) { reportStuck(t, dev, what, "(served by a datapath process)") }
			before := writeIOs(dev)
			f := startFio(t, dev, int(time.Now().UnixNano()%1000000)+11)
			waitWrites(t, f, dev, before, 256)
			n := srv.kill()
			down := time.Now()
			t.Logf("SIGKILL nbd-server (%d processes) after %d writes; a successor datapath starts", n, writeIOs(dev)-before)
			next, said := startChildAsync(t, cs)
			taken := func(s childSaid) {
				t.Helper()
				if s.taken != 1 || s.dev != dev {
					t.Fatalf("the successor took %d volumes, device %s; want 1, %s", s.taken, s.dev, dev)
				}
				prev.Process.Kill()
				prev.Wait()
			}
			quiesces := mode == attach.Relay || mode == attach.Ublk
			if quiesces {
				// The outage lasts: the successor must not be ready in it.
				if s, ok := awaitChild(t, said, outage); ok {
					t.Fatalf("the successor took %d volumes (device %s) %v into the outage: the predecessor cannot have quiesced",
						s.taken, s.dev, time.Since(down).Round(time.Millisecond))
				}
			} else {
				s, ok := awaitChild(t, said, 2*time.Minute)
				if !ok {
					t.Fatal("the successor did not take the volume within 2 minutes")
				}
				taken(s)
				t.Logf("handed over %v into the outage; predecessor SIGKILLed", time.Since(down).Round(time.Millisecond))
				holdRunning(t, f, outage-time.Since(down), "the outage")
			}
			if !f.running() {
				t.Fatalf("fio ended during the outage: %v\n%s", f.res, tail(f.res.output, 40))
			}
			if err := srv.start(); err != nil {
				t.Fatalf("restart nbd-server: %v", err)
			}
			back := time.Now()
			if quiesces {
				s, ok := awaitChild(t, said, 2*time.Minute)
				if !ok {
					stuck("the handover after the outage")
					t.Fatal("the successor did not take the volume within 2 minutes of the server's return")
				}
				taken(s)
				t.Logf("handed over %v after the server came back (outage %v); predecessor SIGKILLed",
					time.Since(back).Round(time.Millisecond), back.Sub(down).Round(time.Millisecond))
			}
			res := f.wait(t, roundLimit, stuck)
			if !res.ok() {
				t.Fatalf("fio across an outage with a handover in it: %v\n%s", res, tail(res.output, 40))
			}
			t.Logf("fio across the outage and the handover: %v", res)
			compareWithImage(t, srv.image, dev, stuck)
			healthyDetach(t, cs, mode)
			next.Process.Kill()
			next.Wait()
		})
	}
}
