package fuse

import (
	"context"
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
