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

package faults

import (
	"context"
	"testing"
	"time"

	"github.com/mpnbd/mpnbd/pkg/attach"
)

// TestFuseSubflowsRestoredUnderKills: a fuse volume attached over 4 MPTCP
// paths while path 4 is cut runs on 3 subflows; once the path is back,
// its volume server process swaps in a connection with all 4 (a join the
// kernel never retries) while fio writes and verifies; then the storage
// server is SIGKILLed and restarted under fio again and again. Every fio
// round verifies with no I/O error, and the volume ends on 4 subflows.
// Real processes throughout: the storage server, the volume's server
// process, fio; this test's process is the client host (a network
// namespace of its own).
func TestFuseSubflowsRestoredUnderKills(t *testing.T) {
	fp, ok := newFourPaths(t, 256<<20)
	if !ok {
		return
	}
	fp.link(t, 4, "down")
	att := fp.attach(t, "pv-subflows")
	a, s := fp.a, fp.srv
	health := func() attach.Health {
		t.Helper()
		h, err := a.Health("pv-subflows")
		if err != nil {
			t.Fatal(err)
		}
		return h
	}
	subflows := func(h attach.Health) int {
		if len(h.Subflows) != 1 {
			return 0
		}
		return h.Subflows[0]
	}
	time.Sleep(3 * time.Second)
	if h := health(); !h.MPTCP || subflows(h) != 3 {
		t.Fatalf("with path 4 cut: %+v, want MPTCP with 3 subflows", h)
	}

	// fio writes and verifies, round after round, through everything
	// that follows.
	finish, failed := fioRounds(t, 3*time.Minute, func(ctx context.Context, n int) (string, error) {
		return fioVerifyCtx(ctx, att.Device, 32<<20, n, "randwrite", "4k")
	})

	fp.link(t, 4, "up")
	// The keeper looks every 5 s and acts after 20 s short.
	deadline := time.Now().Add(90 * time.Second)
	for h := health(); subflows(h) != 4 || h.Replaced == 0; h = health() {
		if time.Now().After(deadline) {
			finish()
			t.Fatalf("90 s after path 4 came back: %+v, want 4 subflows after a swap", h)
		}
		select {
		case f := <-failed:
			t.Fatalf("fio: %s", f)
		case <-time.After(time.Second):
		}
	}
	t.Logf("all 4 subflows back by a swap %v after the path came back", time.Since(deadline.Add(-90*time.Second)).Round(time.Second))

	p := faultPlan()
	killStop := make(chan struct{})
	kills := killer(t, s, p, killStop)
	time.Sleep(p.duration)
	close(killStop)
	nk := <-kills
	n := finish()
	if nk == 0 {
		t.Fatal("the server was never killed: the run proves nothing")
	}
	deadline = time.Now().Add(30 * time.Second)
	for h := health(); subflows(h) != 4 || !h.Connected; h = health() {
		if time.Now().After(deadline) {
			t.Fatalf("after the kills: %+v, want connected on 4 subflows", h)
		}
		time.Sleep(500 * time.Millisecond)
	}
	h := health()
	t.Logf("%d fio write+verify rounds across the swap and %d SIGKILLs of the server: 0 I/O errors, 0 verify failures; %d swap(s), %d reconnects",
		n, nk, h.Replaced, h.Reconnects)
}
