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

package driver

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"

	"github.com/mpnbd/mpnbd/api/v1alpha1"
	"github.com/mpnbd/mpnbd/pkg/attach"
)

// fakeStatus keeps the entries a VolumeWatch writes; fail makes the next
// writes fail.
type fakeStatus struct {
	mu      sync.Mutex
	entries map[string]v1alpha1.NodeAttachment
	writes  int
	fail    error
}

func (f *fakeStatus) Apply(_ context.Context, id string, a v1alpha1.NodeAttachment) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.fail != nil {
		return f.fail
	}
	if a.LastUpdateTime.IsZero() {
		return errors.New("no lastUpdateTime")
	}
	if f.entries == nil {
		f.entries = map[string]v1alpha1.NodeAttachment{}
	}
	f.entries[id] = a
	f.writes++
	return nil
}

func (f *fakeStatus) Remove(_ context.Context, id string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.fail != nil {
		return f.fail
	}
	delete(f.entries, id)
	f.writes++
	return nil
}

// entry returns the entry of id as "transport subflows connected", or
// "none".
func (f *fakeStatus) entry(id string) string {
	f.mu.Lock()
	defer f.mu.Unlock()
	e, ok := f.entries[id]
	if !ok {
		return "none"
	}
	return fmt.Sprintf("%s %s %v", e.Transport, e.Subflows, e.Connected)
}

// attachedLister lists what the fake attacher has attached.
type attachedLister struct{ f *fakeAttacher }

func (l attachedLister) Volumes() map[string]attach.Transport {
	l.f.mu.Lock()
	defer l.f.mu.Unlock()
	out := map[string]attach.Transport{}
	for id, a := range l.f.attached {
		out[id] = a.Transport
	}
	return out
}

// TestVolumeWatch runs a watch against a node service: a stage records
// TransportChosen and writes the node's entry, health changes update it
// and record Events (paths degraded only once held), an unstage removes
// it, and failed writes are retried.
func TestVolumeWatch(t *testing.T) {
	f := newNodeFixture(t)
	sink := &sinkRecorder{}
	st := &fakeStatus{}
	w := &VolumeWatch{Events: sink, Status: st, Every: 10 * time.Millisecond, Hold: 100 * time.Millisecond, Log: slog.New(slog.DiscardHandler)}
	f.node.cfg.Observer = w
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		w.Run(ctx, f.node, attachedLister{f.att})
	}()
	defer func() { cancel(); <-done }()

	set := func(h attach.Health) {
		f.att.mu.Lock()
		f.att.health["pv-1"] = h
		f.att.mu.Unlock()
	}
	wait := func(what string, cond func() string) {
		t.Helper()
		deadline := time.Now().Add(5 * time.Second)
		for {
			msg := cond()
			if msg == "" {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s: %s", what, msg)
			}
			time.Sleep(5 * time.Millisecond)
		}
	}
	events := func(want ...string) func() string {
		return func() string {
			if got := sink.get(); !slices.Equal(got, want) {
				return fmt.Sprintf("events %v, want %v", got, want)
			}
			return ""
		}
	}
	entry := func(want string) func() string {
		return func() string {
			if got := st.entry("pv-1"); got != want {
				return fmt.Sprintf("entry %q, want %q", got, want)
			}
			return ""
		}
	}

	// The stage's addresses: 2 subflows expected.
	set(attach.Health{Connected: true, MPTCP: true, Subflows: []int{2}})
	stage := f.stageReq("pv-1", mountCap(rwo, ""))
	if _, err := f.node.NodeStageVolume(ctx, stage); err != nil {
		t.Fatal(err)
	}
	chosen := "pv-1:" + EventTransportChosen
	wait("stage", events(chosen))
	wait("stage", entry("fuse 2/2 true"))
	// A repeated stage (kubelet restarted) records nothing more.
	if _, err := f.node.NodeStageVolume(ctx, stage); err != nil {
		t.Fatal(err)
	}

	// A dip to one subflow that is gone before the hold says nothing;
	// the entry follows every look.
	set(attach.Health{Connected: true, MPTCP: true, Subflows: []int{1}})
	wait("a dip", entry("fuse 1/2 true"))
	set(attach.Health{Connected: true, MPTCP: true, Subflows: []int{2}})
	wait("after the dip", entry("fuse 2/2 true"))
	time.Sleep(150 * time.Millisecond)
	wait("after the dip", events(chosen))

	// Degraded for longer than the hold, then restored.
	set(attach.Health{Connected: true, MPTCP: true, Subflows: []int{1}})
	wait("degraded", events(chosen, "pv-1:"+EventPathsDegraded))
	set(attach.Health{Connected: true, MPTCP: true, Subflows: []int{2}})
	wait("restored", events(chosen, "pv-1:"+EventPathsDegraded, "pv-1:"+EventPathsRestored))

	// The storage node lost: no path Events however long it lasts, the
	// entry says so; then found again.
	set(attach.Health{Connected: false, MPTCP: true, Outage: time.Minute})
	wait("lost", entry("fuse  false"))
	time.Sleep(150 * time.Millisecond)
	set(attach.Health{Connected: true, MPTCP: true, Subflows: []int{2}, Reconnects: 1})
	all := []string{chosen, "pv-1:" + EventPathsDegraded, "pv-1:" + EventPathsRestored, "pv-1:" + EventStorageUnreachable, "pv-1:" + EventStorageReconnected}
	wait("back", events(all...))
	wait("back", entry("fuse 2/2 true"))

	// Writes fail for a while: retried until they work.
	st.mu.Lock()
	st.fail = errors.New("API server away")
	st.mu.Unlock()
	set(attach.Health{Connected: true, MPTCP: true, Subflows: []int{2, 2}, Reconnects: 1})
	time.Sleep(50 * time.Millisecond)
	if got := st.entry("pv-1"); got != "fuse 2/2 true" {
		t.Fatalf("entry %q written through a failing API", got)
	}
	st.mu.Lock()
	st.fail = nil
	st.mu.Unlock()
	wait("after the failures", entry("fuse 2/2,2/2 true"))
	st.mu.Lock()
	writes := st.writes
	st.mu.Unlock()
	time.Sleep(50 * time.Millisecond)
	st.mu.Lock()
	if st.writes != writes {
		t.Errorf("%d writes of an unchanged entry", st.writes-writes)
	}
	st.mu.Unlock()

	// Unstage: the entry goes.
	if _, err := f.node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: "pv-1", StagingTargetPath: stage.StagingTargetPath}); err != nil {
		t.Fatal(err)
	}
	wait("unstage", entry("none"))
	wait("the end", events(all...))
}
