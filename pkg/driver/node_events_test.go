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

func TestWatchVolumeHealth(t *testing.T) {
	f := newNodeFixture(t)
	if _, err := f.node.NodeStageVolume(context.Background(), f.stageReq("pv-1", mountCap(rwo, ""))); err != nil {
		t.Fatal(err)
	}
	f.att.mu.Lock()
	f.att.health["pv-1"] = attach.Health{Connected: true}
	f.att.mu.Unlock()
	sink := &sinkRecorder{}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		WatchVolumeHealth(ctx, f.node, fakeLister{"pv-1": attach.FUSE}, sink, 10*time.Millisecond)
	}()
	defer func() { cancel(); <-done }()
	set := func(h attach.Health) {
		f.att.mu.Lock()
		f.att.health["pv-1"] = h
		f.att.mu.Unlock()
	}
	wait := func(want string) {
		t.Helper()
		deadline := time.Now().Add(5 * time.Second)
		for {
			r := sink.get()
			if len(r) > 0 && r[len(r)-1] == want {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("events %v, want the last to be %s", r, want)
			}
			time.Sleep(5 * time.Millisecond)
		}
	}
	time.Sleep(50 * time.Millisecond)
	if r := sink.get(); len(r) != 0 {
		t.Fatalf("events for a steady volume: %v", r)
	}
	set(attach.Health{Connected: false})
	wait("pv-1:" + EventStorageUnreachable)
	set(attach.Health{Connected: true, Reconnects: 1})
	wait("pv-1:" + EventStorageReconnected)
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
