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
	"encoding/json"
	"fmt"
	"log/slog"
	"net/http"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/rest"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/mpnbd/mpnbd/api/v1alpha1"
	"github.com/mpnbd/mpnbd/internal/testenv/apiserver"
	"github.com/mpnbd/mpnbd/internal/testenv/repo"
	"github.com/mpnbd/mpnbd/pkg/attach"
)

// TestNodeStatusAPIServer checks the node plugin's entries in
// status.attachments against a real kube-apiserver: applied, updated and
// removed by server-side apply, one per node side by side, untouched by
// the storage agent's merge patches of the status, shown by the
// printer columns of -o wide; and a VolumeWatch over a node service
// writing them and the claim's TransportChosen Event.
func TestNodeStatusAPIServer(t *testing.T) {
	cfg, c := apiserver.Start(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()

	newVolume := func(name string) {
		t.Helper()
		v := &v1alpha1.NBDVolume{
			ObjectMeta: metav1.ObjectMeta{Name: name},
			Spec:       v1alpha1.NBDVolumeSpec{SizeBytes: gib, StorageNode: "storage-1", AccessType: v1alpha1.AccessFilesystem},
		}
		if err := c.Create(ctx, v); err != nil {
			t.Fatal(err)
		}
		v.Status = v1alpha1.NBDVolumeStatus{Phase: v1alpha1.VolumeAvailable, CapacityBytes: gib, ObservedGeneration: 1,
			Export: &v1alpha1.Export{Name: name, Port: 10809, Addresses: []string{"192.0.2.1"}}}
		if err := c.Status().Update(ctx, v); err != nil {
			t.Fatal(err)
		}
	}
	// entries returns a volume's attachments as "node transport subflows
	// connected", in order.
	entries := func(name string) []string {
		t.Helper()
		v := getVolume(t, c, name)
		var out []string
		for _, a := range v.Status.Attachments {
			if a.LastUpdateTime.IsZero() {
				t.Errorf("entry %+v without a time", a)
			}
			out = append(out, fmt.Sprintf("%s %s %s %v", a.NodeID, a.Transport, a.Subflows, a.Connected))
		}
		return out
	}
	want := func(name string, w ...string) {
		t.Helper()
		if got := entries(name); !slices.Equal(got, w) {
			t.Fatalf("attachments of %s: %q, want %q", name, got, w)
		}
	}
	entry := func(tr, subflows string, connected bool) v1alpha1.NodeAttachment {
		return v1alpha1.NodeAttachment{Transport: tr, Subflows: subflows, Connected: connected, LastUpdateTime: metav1.Now()}
	}
	nodeA := &KubeAttachmentStatus{Client: c, NodeID: "node-a"}
	nodeB := &KubeAttachmentStatus{Client: c, NodeID: "node-b"}

	t.Run("entries", func(t *testing.T) {
		newVolume("st-1")
		// The agent's view of the volume before any node wrote.
		stale := getVolume(t, c, "st-1")

		if err := nodeA.Apply(ctx, "st-1", entry("fuse", "3/4", true)); err != nil {
			t.Fatal(err)
		}
		want("st-1", "node-a fuse 3/4 true")
		if err := nodeB.Apply(ctx, "st-1", entry("relay", "4/4,4/4", true)); err != nil {
			t.Fatal(err)
		}
		want("st-1", "node-a fuse 3/4 true", "node-b relay 4/4,4/4 true")
		// An update replaces the node's own entry, subflows gone while
		// disconnected.
		if err := nodeA.Apply(ctx, "st-1", entry("fuse", "", false)); err != nil {
			t.Fatal(err)
		}
		want("st-1", "node-a fuse  false", "node-b relay 4/4,4/4 true")
		v := getVolume(t, c, "st-1")
		var managers []string
		for _, m := range v.ManagedFields {
			if m.Subresource == "status" && m.Operation == metav1.ManagedFieldsOperationApply {
				managers = append(managers, m.Manager)
			}
		}
		if slices.Sort(managers); !slices.Equal(managers, []string{"mpnbd-node/node-a", "mpnbd-node/node-b"}) {
			t.Errorf("status apply managers %v", managers)
		}

		// The storage agent's status writes: a merge patch of what it
		// changed, from a fresh copy and from one that predates the
		// entries.
		for i, base := range []*v1alpha1.NBDVolume{getVolume(t, c, "st-1"), stale} {
			orig := base.DeepCopy()
			vol := base.DeepCopy()
			vol.Status.CapacityBytes = int64(2+i) * gib
			vol.Status.Phase = v1alpha1.VolumeAvailable
			meta.SetStatusCondition(&vol.Status.Conditions, metav1.Condition{Type: "Ready", Status: metav1.ConditionTrue, Reason: "Available", Message: fmt.Sprint(i)})
			if err := c.Status().Patch(ctx, vol, client.MergeFrom(orig)); err != nil {
				t.Fatal(err)
			}
			if got := getVolume(t, c, "st-1"); got.Status.CapacityBytes != int64(2+i)*gib {
				t.Fatalf("the agent's patch %d did not land: %+v", i, got.Status)
			}
			want("st-1", "node-a fuse  false", "node-b relay 4/4,4/4 true")
		}

		// Unstage on node-a: its entry goes, node-b's stays; twice is
		// fine, and so is a volume that is gone.
		for range 2 {
			if err := nodeA.Remove(ctx, "st-1"); err != nil {
				t.Fatal(err)
			}
			want("st-1", "node-b relay 4/4,4/4 true")
		}
		if err := nodeA.Remove(ctx, "no-such-volume"); err != nil {
			t.Errorf("removing from a missing volume: %v", err)
		}
		if err := nodeA.Apply(ctx, "no-such-volume", entry("fuse", "", true)); err != nil {
			t.Errorf("applying to a missing volume: %v", err)
		}
		if got := getVolume(t, c, "st-1"); got.Status.CapacityBytes != 3*gib || got.Status.Export == nil || len(got.Status.Conditions) != 1 {
			t.Errorf("the node's writes changed the agent's status: %+v", got.Status)
		}
	})

	t.Run("printer columns", func(t *testing.T) {
		newVolume("st-wide")
		if err := nodeA.Apply(ctx, "st-wide", entry("fuse", "4/4", true)); err != nil {
			t.Fatal(err)
		}
		// The table the API server serves kubectl.
		hc, err := rest.HTTPClientFor(cfg)
		if err != nil {
			t.Fatal(err)
		}
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, strings.TrimSuffix(cfg.Host, "/")+"/apis/mpnbd.io/v1alpha1/nbdvolumes/st-wide", nil)
		if err != nil {
			t.Fatal(err)
		}
		req.Header.Set("Accept", "application/json;as=Table;v=v1;g=meta.k8s.io")
		resp, err := hc.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var table metav1.Table
		if err := json.NewDecoder(resp.Body).Decode(&table); err != nil || resp.StatusCode != http.StatusOK {
			t.Fatalf("table: %s, %v", resp.Status, err)
		}
		cells := map[string]any{}
		priority := map[string]int32{}
		for i, col := range table.ColumnDefinitions {
			priority[col.Name] = col.Priority
			if len(table.Rows) == 1 && i < len(table.Rows[0].Cells) {
				cells[col.Name] = table.Rows[0].Cells[i]
			}
		}
		if cells["Transport"] != "fuse" || cells["Subflows"] != "4/4" || priority["Transport"] != 1 || priority["Subflows"] != 1 || priority["Phase"] != 0 {
			t.Fatalf("table cells %v, priorities %v", cells, priority)
		}

		// And kubectl, where there is one.
		kubectl, err := exec.LookPath("kubectl")
		if err != nil {
			root, rerr := repo.Root()
			if rerr != nil {
				t.Fatal(rerr)
			}
			out, berr := exec.Command(filepath.Join(root, "hack", "kube-binaries.sh")).Output()
			dir, ok := strings.CutPrefix(strings.TrimSpace(string(out)), "KUBE_BIN=")
			if berr != nil || !ok {
				t.Skipf("no kubectl: %v", err)
			}
			kubectl = filepath.Join(dir, "kubectl")
		}
		kc := apiserver.WriteKubeconfig(t, cfg)
		get := func(args ...string) string {
			out, err := exec.CommandContext(ctx, kubectl, append([]string{"--kubeconfig", kc, "get", "nbdvol", "st-wide"}, args...)...).CombinedOutput()
			if err != nil {
				t.Fatalf("kubectl get %v: %v: %s", args, err, out)
			}
			return string(out)
		}
		wide := strings.Split(strings.TrimSpace(get("-o", "wide")), "\n")
		if len(wide) != 2 {
			t.Fatalf("kubectl get -o wide:\n%s", strings.Join(wide, "\n"))
		}
		// A column's cell starts where its header does.
		cell := func(name string) string {
			i := strings.Index(wide[0], name)
			if i < 0 || i >= len(wide[1]) {
				return ""
			}
			if f := strings.Fields(wide[1][i:]); len(f) > 0 {
				return f[0]
			}
			return ""
		}
		if cell("TRANSPORT") != "fuse" || cell("SUBFLOWS") != "4/4" {
			t.Fatalf("kubectl get -o wide:\n%s", strings.Join(wide, "\n"))
		}
		if plain := get(); strings.Contains(plain, "TRANSPORT") || strings.Contains(plain, "4/4") {
			t.Errorf("kubectl get without -o wide shows the wide columns:\n%s", plain)
		}
		t.Logf("kubectl get nbdvol -o wide:\n%s", strings.Join(wide, "\n"))
	})

	t.Run("watch", func(t *testing.T) {
		const ns = "status-apps"
		if err := c.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}); err != nil {
			t.Fatal(err)
		}
		newVolume("st-watch")
		pv := &corev1.PersistentVolume{
			ObjectMeta: metav1.ObjectMeta{Name: "st-watch"},
			Spec: corev1.PersistentVolumeSpec{
				Capacity:                      corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("1Gi")},
				AccessModes:                   []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
				PersistentVolumeSource:        corev1.PersistentVolumeSource{CSI: &corev1.CSIPersistentVolumeSource{Driver: DriverName, VolumeHandle: "st-watch"}},
				ClaimRef:                      &corev1.ObjectReference{Namespace: ns, Name: "data", UID: "uid-data"},
				PersistentVolumeReclaimPolicy: corev1.PersistentVolumeReclaimDelete,
			},
		}
		if err := c.Create(ctx, pv); err != nil {
			t.Fatal(err)
		}
		f := newNodeFixture(t)
		f.node.cfg.NodeID = "node-w"
		log := slog.New(slog.DiscardHandler)
		w := &VolumeWatch{
			Events: &KubeEvents{Client: c, NodeID: "node-w", Log: log},
			Status: &KubeAttachmentStatus{Client: c, NodeID: "node-w"},
			Every:  50 * time.Millisecond, Hold: time.Second, Log: log,
		}
		f.node.cfg.Observer = w
		wctx, stop := context.WithCancel(ctx)
		done := make(chan struct{})
		go func() {
			defer close(done)
			w.Run(wctx, f.node, attachedLister{f.att})
		}()
		defer func() { stop(); <-done }()
		f.att.health["st-watch"] = attach.Health{Connected: true, MPTCP: true, Subflows: []int{2}}

		stage := f.stageReq("st-watch", mountCap(rwo, ""))
		if _, err := f.node.NodeStageVolume(ctx, stage); err != nil {
			t.Fatal(err)
		}
		waitUntil(t, "the node's entry", func() string {
			if got := entries("st-watch"); !slices.Equal(got, []string{"node-w fuse 2/2 true"}) {
				return fmt.Sprintf("entries %q", got)
			}
			return ""
		})
		waitUntil(t, "the claim's TransportChosen", func() string {
			var evs corev1.EventList
			if err := c.List(ctx, &evs, client.InNamespace(ns)); err != nil {
				return err.Error()
			}
			for _, e := range evs.Items {
				if e.Reason == EventTransportChosen && e.InvolvedObject.Name == "data" && e.InvolvedObject.Kind == "PersistentVolumeClaim" &&
					e.Type == corev1.EventTypeNormal && strings.Contains(e.Message, "fuse") {
					return ""
				}
			}
			return fmt.Sprintf("events %+v", evs.Items)
		})
		if _, err := f.node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: "st-watch", StagingTargetPath: stage.StagingTargetPath}); err != nil {
			t.Fatal(err)
		}
		waitUntil(t, "the entry removed", func() string {
			if got := entries("st-watch"); len(got) != 0 {
				return fmt.Sprintf("entries %q", got)
			}
			return ""
		})
	})
}

func waitUntil(t *testing.T, what string, cond func() string) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		msg := cond()
		if msg == "" {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: %s", what, msg)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
