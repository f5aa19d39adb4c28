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

package fuse

import (
	"context"
	"slices"
	"syscall"
	"testing"
	"time"

	"github.com/mpnbd/mpnbd/pkg/attach"
)

// TestHandoffPredecessorWaitsForItsVerdict: a server quiesced for a
// handoff serves nothing until its caller says resume or release, however
// long that takes: resuming on a timeout of its own, it would serve (and
// acknowledge writes) while its caller, alive, may be releasing it to a
// successor.
func TestHandoffPredecessorWaitsForItsVerdict(t *testing.T) {
	requireFUSE(t)
	// The server processes started from here on resume, if they do, after
	// this long.
	t.Setenv(handoffTimeoutEnv, "200ms")
	ts := localServer(t, 64<<20)
	a := newAttacher(t, Config{StateDir: t.TempDir() + "/state"})
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	const id = "pv-handoff-verdict"
	att, err := a.Attach(ctx, target(id, ts.addr), attach.Options{})
	if err != nil {
		t.Fatal(err)
	}
	w := startWriter(t, att.Device, 16)
	w.waitWrites(t, 20)
	h, err := a.HandOff(ctx, id)
	if err != nil {
		t.Fatal(err)
	}
	n0 := w.writes.Load()
	// Ten times the timeout a server would resume after.
	time.Sleep(2 * time.Second)
	served := w.writes.Load() - n0
	rerr := h.Resume()
	if served > 1 || rerr != nil {
		// The writer stops first: a test that ends with it blocked on the
		// device would leave the device busy.
		w.finish(t)
		// One write may have been answered as the server quiesced.
		t.Fatalf("the quiesced server served %d writes with no verdict (it resumed on a timeout of its own); Resume: %v", served, rerr)
	}
	w.waitWrites(t, 20)
	w.finish(t)
	w.verify(t, att.Device, ts.backend)
	if err := a.Detach(ctx, id); err != nil {
		t.Fatal(err)
	}
	assertNothingLeft(t, a, id, ts)
}

// TestHandoffSuccessorWaitsForThePredecessorsExit: told to start while
// the predecessor server still runs (it resumed: the process that handed
// the volume off went away before its verdict, and the successor's side
// took that for a release), the successor does not serve beside it; it
// gives up at its deadline and the predecessor serves on.
func TestHandoffSuccessorWaitsForThePredecessorsExit(t *testing.T) {
	requireFUSE(t)
	old := handoffTimeout
	handoffTimeout = 2 * time.Second // the successor's deadline
	t.Cleanup(func() { handoffTimeout = old })
	ts := localServer(t, 64<<20)
	stateDir := t.TempDir() + "/state"
	a := newAttacher(t, Config{StateDir: stateDir})
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	const id = "pv-handoff-pred-lives"
	att, err := a.Attach(ctx, target(id, ts.addr), attach.Options{})
	if err != nil {
		t.Fatal(err)
	}
	pid := serverPid(t, a, id)
	w := startWriter(t, att.Device, 16)
	w.waitWrites(t, 20)
	h, err := a.HandOff(ctx, id)
	if err != nil {
		t.Fatal(err)
	}
	before := liveServers(t)
	b := New(Config{StateDir: stateDir})
	if _, err := b.TakeHandoff(ctx, h); err != nil {
		t.Fatal(err)
	}
	var succ int
	for _, p := range liveServers(t) {
		if !slices.Contains(before, p) {
			succ = p
		}
	}
	if succ == 0 {
		t.Fatal("no successor process")
	}
	// The predecessor serves again, as on the end of its caller's
	// connection.
	if err := h.Resume(); err != nil {
		t.Fatalf("Resume: %v", err)
	}
	if err := h.Start(); err == nil {
		// Two servers read the one FUSE connection: end the successor
		// before the writer, whose requests it may hold.
		syscall.Kill(succ, syscall.SIGKILL)
		w.finish(t)
		t.Fatal("the successor serves while the predecessor it took the volume from still serves it: two servers")
	}
	w.waitWrites(t, 20)
	w.finish(t)
	w.verify(t, att.Device, ts.backend)
	if got := serverPid(t, a, id); got != pid {
		t.Fatalf("the volume's server is %d, want the predecessor %d", got, pid)
	}
	if err := a.Detach(ctx, id); err != nil {
		t.Fatal(err)
	}
	assertNothingLeft(t, a, id, ts)
}
