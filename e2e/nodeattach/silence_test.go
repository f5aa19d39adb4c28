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
	"os/exec"
	"testing"
	"time"

	"github.com/mpnbd/mpnbd/internal/testenv/topo"
	"github.com/mpnbd/mpnbd/pkg/attach"
)

// silenceBound is how long a transport may take to notice a silent
// storage host or path: far below tcp_retries2 (about 15 minutes), above
// the default dead-peer bound (5 s) with room for TCG.
const silenceBound = 15 * time.Second

// TestTransportsSilentStorage (MPNBD_SOAK=1, or MPNBD_VM_RUN naming it):
// the kernel's nbd under fio write+verify while our nbd-server's host
// falls silent (nftables drops everything in its namespace: no reset,
// no ICMP) for 20 s, or, for multiconn, one of its four paths does. Each
// transport must notice within silenceBound (a reconnect, or the health
// saying disconnected); fio must finish with no error and every block
// verified, and the device must read back the server's file.
//
// The kernel requeues the requests of a socket it found dead only when
// their request timeout passes, not when the socket dies: multiconn runs
// here with a class's short request timeout (10 s, so a dead-peer bound
// of 5 s) and must carry on over its other paths while path 1 is still
// silent, its longest stall under silenceBound.
func TestTransportsSilentStorage(t *testing.T) {
	requireGuest(t)
	requireFaultTools(t)
	if _, err := exec.LookPath("nft"); err != nil {
		t.Skipf("nft is not in the VM (the host test copies it from the host: install the Debian package nftables): %v", err)
	}
	t.Parallel()
	const silence = 20 * time.Second
	for _, mode := range []attach.Transport{attach.Relay, attach.TCP, attach.MultiConn} {
		t.Run(string(mode), func(t *testing.T) {
			t.Parallel()
			newTopology := plainGuestTopology
			if mode == attach.Relay {
				newTopology = guestTopology
			}
			tp := newTopology(t)
			srv := startOurServer(t, tp, faultExportSize)
			a, _ := newAttacher(t, tp, mode)
			tg := srv.target(volID(t))
			var o attach.Options
			if mode == attach.MultiConn {
				o.RequestTimeout = 10 * time.Second
			}
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			att, err := a.Attach(ctx, tg, o)
			cancel()
			if err != nil {
				t.Fatalf("attach %s: %v", mode, err)
			}
			t.Cleanup(func() {
				if err := a.Detach(context.Background(), tg.VolumeID); err != nil {
					t.Errorf("detach: %v", err)
				}
			})
			before := writeIOs(att.Device)
			f := startFio(t, att.Device, int(time.Now().UnixNano()%1000000)+23)
			waitWrites(t, f, att.Device, before, 256)
			h0, _ := a.Health(tg.VolumeID)
			ifname, what := "", "the storage host"
			if mode == attach.MultiConn {
				ifname, what = tp.Paths[0].ServerIf, "path 1 of 4"
			}
			if err := topo.Drop(tp.ServerNS, "silence", ifname); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = topo.Undrop(tp.ServerNS, "silence") })
			start := time.Now()
			var noticed time.Duration
			// The longest time without a completed I/O (reads count: fio
			// verifies after it wrote), from the silence on.
			lastIOs, lastMove, stall := deviceIOs(att.Device), start, time.Duration(0)
			lifted := false
			for f.running() && time.Since(start) < roundLimit {
				if !lifted && time.Since(start) >= silence {
					if err := topo.Undrop(tp.ServerNS, "silence"); err != nil {
						t.Fatal(err)
					}
					lifted = true
				}
				h, _ := a.Health(tg.VolumeID)
				if noticed == 0 && (!h.Connected || h.Reconnects > h0.Reconnects) {
					noticed = time.Since(start)
				}
				if n := deviceIOs(att.Device); n != lastIOs {
					lastIOs, lastMove = n, time.Now()
				}
				stall = max(stall, time.Since(lastMove))
				time.Sleep(100 * time.Millisecond)
			}
			if !lifted {
				if err := topo.Undrop(tp.ServerNS, "silence"); err != nil {
					t.Fatal(err)
				}
			}
			res := f.wait(t, roundLimit, attacherStuck(t, a, tg, att.Device))
			h, _ := a.Health(tg.VolumeID)
			t.Logf("%s: %s silent for %v: noticed after %v; longest I/O stall %v; fio %v in %v; health %+v",
				mode, what, silence, noticed.Round(time.Millisecond), stall.Round(time.Millisecond), res, res.elapsed.Round(time.Millisecond), h)
			if !res.ok() {
				t.Fatalf("fio across the silence: %v\n%s", res, tail(res.output, 40))
			}
			if noticed == 0 || noticed > silenceBound {
				t.Errorf("the silence was not noticed within %v (noticed after %v)", silenceBound, noticed)
			}
			if mode == attach.MultiConn && stall > silenceBound {
				t.Errorf("multiconn stalled %v with three paths of four working", stall)
			}
			compareWithImage(t, srv.image, att.Device, attacherStuck(t, a, tg, att.Device))
		})
	}
}
