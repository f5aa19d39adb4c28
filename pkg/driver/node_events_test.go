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
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/client/fake"

	"github.com/mpnbd/mpnbd/pkg/attach"
)

func TestHealthEvents(t *testing.T) {
	up := attach.Health{Connected: true, Reconnects: 1}
	down := attach.Health{Connected: false, Reconnects: 1, Outage: 42 * time.Second, Message: "waiting"}
	failing := attach.Health{Connected: false, Reconnects: 1, Outage: 90 * time.Second, Failing: true}
	cases := []struct {
		name      string
		prev, cur attach.Health
		reasons   []string
	}{
		{"steady", up, up, nil},
		{"lost", up, down, []string{EventStorageUnreachable}},
		{"still lost", down, down, nil},
		{"back", down, attach.Health{Connected: true, Reconnects: 2}, []string{EventStorageReconnected}},
		{"blip between looks", up, attach.Health{Connected: true, Reconnects: 3}, []string{EventStorageReconnected}},
		{"back with writes resent", down, attach.Health{Connected: true, Reconnects: 2, Resent: 9}, []string{EventStorageReconnected, EventWritesResent}},
		{"wait outlasted", down, failing, []string{EventIOFailing}},
		{"still failing", failing, failing, nil},
		{"lost and failing at once", up, failing, []string{EventStorageUnreachable, EventIOFailing}},
		{"back after failing", failing, attach.Health{Connected: true, Reconnects: 2}, []string{EventStorageReconnected}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			var got []string
			for _, e := range healthEvents(tc.prev, tc.cur, attach.Relay) {
				got = append(got, e.reason)
				if e.message == "" {
					t.Errorf("%s without a message", e.reason)
				}
			}
			if strings.Join(got, ",") != strings.Join(tc.reasons, ",") {
				t.Fatalf("events %v, want %v", got, tc.reasons)
			}
		})
	}
	if e := healthEvents(down, attach.Health{Connected: true}, attach.FUSE)[0]; !strings.Contains(e.message, "42s") {
		t.Errorf("reconnect message %q does not say how long the outage was", e.message)
	}
}

func TestChoiceEvents(t *testing.T) {
	fb := func(from, to attach.Transport) attach.Fallback {
		return attach.Fallback{From: from, To: to, Reason: string(from) + " said no"}
	}
	cases := []struct {
		name    string
		att     attach.Attachment
		reasons []string
		// chosen holds what TransportChosen's message must say.
		chosen []string
	}{
		{"repeated stage", attach.Attachment{Transport: attach.Relay}, nil, nil},
		{"first choice", attach.Attachment{Transport: attach.Kernel, MPTCP: true, Choice: &attach.Choice{Requested: attach.Auto}},
			[]string{EventTransportChosen}, []string{"kernel", "over MPTCP", "first choice"}},
		{"pinned", attach.Attachment{Transport: attach.TCP, Choice: &attach.Choice{Requested: attach.TCP}},
			[]string{EventTransportChosen}, []string{"tcp", "without MPTCP", "StorageClass"}},
		{"only fuse on the node", attach.Attachment{Transport: attach.FUSE, MPTCP: true, Choice: &attach.Choice{Requested: attach.Auto, Missing: []attach.Transport{attach.Kernel, attach.Ublk, attach.Relay}}},
			[]string{EventTransportChosen}, []string{"fuse", "no kernel, ublk, relay transport"}},
		{"two refused", attach.Attachment{Transport: attach.Relay, MPTCP: true, Choice: &attach.Choice{Requested: attach.Auto,
			Skipped: []attach.Fallback{fb(attach.Kernel, attach.Ublk), fb(attach.Ublk, attach.Relay)}}},
			[]string{EventTransportFallback, EventTransportFallback, EventTransportChosen}, []string{"relay", "after kernel, ublk refused"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			evs := choiceEvents(&tc.att)
			var got []string
			for _, e := range evs {
				got = append(got, e.reason)
			}
			if strings.Join(got, ",") != strings.Join(tc.reasons, ",") {
				t.Fatalf("events %v, want %v", got, tc.reasons)
			}
			for i, e := range evs {
				switch e.reason {
				case EventTransportFallback:
					f := tc.att.Choice.Skipped[i]
					if e.typ != corev1.EventTypeWarning || !strings.Contains(e.message, f.Reason) || !strings.Contains(e.message, string(f.To)) {
						t.Errorf("fallback %+v: event %+v", f, e)
					}
				case EventTransportChosen:
					if e.typ != corev1.EventTypeNormal {
						t.Errorf("%s is %s", e.reason, e.typ)
					}
					for _, w := range tc.chosen {
						if !strings.Contains(e.message, w) {
							t.Errorf("TransportChosen %q does not say %q", e.message, w)
						}
					}
				}
			}
		})
	}
}

func TestPathsEvents(t *testing.T) {
	const hold = 15 * time.Second
	// Each look: seconds since the start, and whether it found the
	// volume degraded; want is the Event the look records, if any.
	type look struct {
		at       int
		degraded bool
		want     string
	}
	cases := []struct {
		name  string
		looks []look
	}{
		{"healthy", []look{{0, false, ""}, {5, false, ""}, {60, false, ""}}},
		{"dip between two looks", []look{{0, false, ""}, {5, true, ""}, {10, false, ""}, {15, false, ""}, {30, false, ""}}},
		{"dip shorter than the hold", []look{{0, true, ""}, {5, true, ""}, {10, true, ""}, {15, false, ""}, {20, true, ""}, {25, false, ""}}},
		{"degraded, then restored", []look{{0, true, ""}, {5, true, ""}, {10, true, ""}, {15, true, EventPathsDegraded}, {20, true, ""},
			{25, false, ""}, {30, true, ""}, {35, false, ""}, {40, false, ""}, {45, false, ""}, {50, false, EventPathsRestored}, {55, false, ""}}},
		{"looks far apart", []look{{0, true, ""}, {20, true, EventPathsDegraded}, {40, false, ""}, {60, false, EventPathsRestored}}},
	}
	start := time.Unix(1_700_000_000, 0)
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			var s pathState
			for _, l := range tc.looks {
				evs := pathsEvents(&s, l.degraded, "connection 0 has 2 MPTCP subflows, want 4", start.Add(time.Duration(l.at)*time.Second), hold)
				var got string
				for _, e := range evs {
					got += e.reason
					wantType := corev1.EventTypeNormal
					if e.reason == EventPathsDegraded {
						wantType = corev1.EventTypeWarning
					}
					if e.typ != wantType || e.message == "" {
						t.Errorf("event %+v", e)
					}
				}
				if got != l.want {
					t.Fatalf("look at %ds (degraded %v): events %q, want %q", l.at, l.degraded, got, l.want)
				}
			}
		})
	}
}

type sinkRecorder struct {
	mu      sync.Mutex
	reasons []string
}

func (s *sinkRecorder) VolumeEvent(_ context.Context, id, _, reason, _ string) {
	s.mu.Lock()
	s.reasons = append(s.reasons, id+":"+reason)
	s.mu.Unlock()
}

func (s *sinkRecorder) get() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]string(nil), s.reasons...)
}

func TestKubeEventsOnClaim(t *testing.T) {
	scheme := runtime.NewScheme()
	if err := corev1.AddToScheme(scheme); err != nil {
		t.Fatal(err)
	}
	pv := &corev1.PersistentVolume{
		ObjectMeta: metav1.ObjectMeta{Name: "pvc-1"},
		Spec: corev1.PersistentVolumeSpec{
			PersistentVolumeSource: corev1.PersistentVolumeSource{CSI: &corev1.CSIPersistentVolumeSource{Driver: DriverName, VolumeHandle: "pvc-1"}},
			ClaimRef:               &corev1.ObjectReference{Namespace: "apps", Name: "data", UID: "uid-1"},
		},
	}
	other := &corev1.PersistentVolume{
		ObjectMeta: metav1.ObjectMeta{Name: "static"},
		Spec:       corev1.PersistentVolumeSpec{PersistentVolumeSource: corev1.PersistentVolumeSource{CSI: &corev1.CSIPersistentVolumeSource{Driver: DriverName, VolumeHandle: "another"}}},
	}
	c := fake.NewClientBuilder().WithScheme(scheme).WithObjects(pv, other).Build()
	k := &KubeEvents{Client: c, NodeID: "node-1", Log: slog.New(slog.DiscardHandler)}
	ctx := context.Background()
	k.VolumeEvent(ctx, "pvc-1", corev1.EventTypeWarning, EventStorageUnreachable, "gone")
	k.VolumeEvent(ctx, "static", corev1.EventTypeWarning, EventStorageUnreachable, "not its volume")
	k.VolumeEvent(ctx, "missing", corev1.EventTypeWarning, EventStorageUnreachable, "no PV")
	var evs corev1.EventList
	if err := c.List(ctx, &evs, client.InNamespace("apps")); err != nil {
		t.Fatal(err)
	}
	if len(evs.Items) != 1 {
		t.Fatalf("%d events, want 1: %+v", len(evs.Items), evs.Items)
	}
	e := evs.Items[0]
	if e.InvolvedObject.Kind != "PersistentVolumeClaim" || e.InvolvedObject.Name != "data" || e.InvolvedObject.UID != "uid-1" ||
		e.Reason != EventStorageUnreachable || e.Type != corev1.EventTypeWarning || e.Source.Host != "node-1" || e.Message != "gone" {
		t.Fatalf("event %+v", e)
	}
	var all corev1.EventList
	if err := c.List(ctx, &all); err != nil || len(all.Items) != 1 {
		t.Fatalf("events in all namespaces: %d, %v", len(all.Items), err)
	}
}
