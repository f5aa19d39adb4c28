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

package ublkdev

import (
	"bytes"
	"context"
	"errors"
	"io"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/mpnbd/mpnbd/internal/testenv/powerloss"
	"github.com/mpnbd/mpnbd/pkg/attach"
)

// fakeDevice stands for a ublk device (the tests run without ublk): it
// records what was done to it.
type fakeDevice struct {
	mu      sync.Mutex
	did     []string
	deleted bool
}

func (d *fakeDevice) BlockPath() string { return "/dev/ublkb-fake" }
func (d *fakeDevice) Abandon()          { d.note("abandon") }
func (d *fakeDevice) Delete() error {
	d.note("delete")
	d.mu.Lock()
	d.deleted = true
	d.mu.Unlock()
	return nil
}

func (d *fakeDevice) note(s string) {
	d.mu.Lock()
	d.did = append(d.did, s)
	d.mu.Unlock()
}

func (d *fakeDevice) log() []string {
	d.mu.Lock()
	defer d.mu.Unlock()
	return append([]string(nil), d.did...)
}

// sessionVolume is an Attacher serving volume v1 through a real NBD
// session to node, on a fake device.
func sessionVolume(t *testing.T, node *powerloss.Node) (*Attacher, *volume, *fakeDevice) {
	t.Helper()
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	tg := attach.Target{VolumeID: "v1", Export: powerloss.Export, Addrs: []string{node.Addr}}
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	sess, err := attach.OpenSession(ctx, attach.SessionConfig{Logger: log}, tg, attach.Options{})
	if err != nil {
		t.Fatal(err)
	}
	dev := &fakeDevice{}
	a := &Attacher{cfg: Config{StateDir: t.TempDir()}, log: log, vols: map[string]*volume{}}
	v := &volume{target: tg, sess: sess, dev: dev, devID: 7}
	a.mu.Lock()
	a.register(v)
	a.mu.Unlock()
	t.Cleanup(func() {
		if !v.sess.Relay.Stats().Connected {
			return
		}
		v.sess.Close(time.Second)
	})
	return a, v, dev
}

// shortTeardown makes the bounded waits of a teardown short.
func shortTeardown(t *testing.T) {
	old := teardownTimeout
	teardownTimeout = 100 * time.Millisecond
	t.Cleanup(func() { teardownTimeout = old })
}

// awaitRedials waits until the session has dialed the booting node a few
// times, or done closes.
func awaitRedials(t *testing.T, node *powerloss.Node, done chan struct{}) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for node.Refused() < 3 {
		select {
		case <-done:
			return
		default:
		}
		if time.Now().After(deadline) {
			t.Fatal("the session does not redial the storage node")
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestReleaseKeepsWritesAcknowledgedAfterTheHandoffFlush: a write the
// device acknowledges between the handoff's FLUSH and the release, with
// the storage node losing power (its cache) meanwhile and booting for
// longer than any teardown bound, is durable once the release is over:
// the release drains the session through the outage before it closes it,
// and the successor starts only after.
func TestReleaseKeepsWritesAcknowledgedAfterTheHandoffFlush(t *testing.T) {
	shortTeardown(t)
	node := powerloss.Start(t, 1<<20)
	a, v, dev := sessionVolume(t, node)
	h, err := a.HandOff(t.Context(), "v1")
	if err != nil {
		t.Fatal(err)
	}
	data := bytes.Repeat([]byte("acknowledged after the handoff flush "), 4096/37+1)[:4096]
	if _, err := v.sess.Client.WriteAt(data, 8192); err != nil {
		t.Fatal(err)
	}
	node.PowerLoss()
	released := make(chan struct{})
	go func() {
		defer close(released)
		h.Release()
	}()
	awaitRedials(t, node, released)
	node.Restore()
	select {
	case <-released:
	case <-time.After(30 * time.Second):
		t.Fatal("the release does not end once the storage node is back")
	}
	if got := node.Durable(8192, 4096); !bytes.Equal(got, data) {
		t.Fatal("a write acknowledged before the release is not on the storage node's medium: the release dropped it")
	}
	if did := dev.log(); len(did) != 1 || did[0] != "abandon" {
		t.Fatalf("the device saw %v, want it abandoned", did)
	}
}

// TestDetachWithTheStorageNodeAwayFails: a detach while the storage node
// is away and the session holds writes no FLUSH covered fails, changing
// nothing; once the node is back, the next detach flushes them and
// succeeds.
func TestDetachWithTheStorageNodeAwayFails(t *testing.T) {
	shortTeardown(t)
	node := powerloss.Start(t, 1<<20)
	a, v, dev := sessionVolume(t, node)
	data := bytes.Repeat([]byte("pending at detach "), 4096/18+1)[:4096]
	if _, err := v.sess.Client.WriteAt(data, 0); err != nil {
		t.Fatal(err)
	}
	node.PowerLoss()
	ctx, cancel := context.WithTimeout(t.Context(), 500*time.Millisecond)
	err := a.Detach(ctx, "v1")
	cancel()
	if !errors.Is(err, attach.ErrUnflushed) {
		t.Fatalf("a detach with unflushed writes and the storage node away: %v, want ErrUnflushed", err)
	}
	a.mu.Lock()
	_, still := a.vols["v1"]
	a.mu.Unlock()
	if !still || len(dev.log()) != 0 {
		t.Fatalf("the failed detach changed the volume: attached %v, device %v", still, dev.log())
	}
	node.Restore()
	ctx, cancel = context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	if err := a.Detach(ctx, "v1"); err != nil {
		t.Fatalf("the detach once the storage node is back: %v", err)
	}
	if got := node.Durable(0, 4096); !bytes.Equal(got, data) {
		t.Fatal("a write acknowledged before the detach is not on the storage node's medium")
	}
	if did := dev.log(); len(did) != 1 || did[0] != "delete" {
		t.Fatalf("the device saw %v, want it deleted", did)
	}
}
