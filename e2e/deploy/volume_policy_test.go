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

package deploy

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	authenticationv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller/controllerutil"

	"github.com/mpnbd/mpnbd/api/v1alpha1"
	"github.com/mpnbd/mpnbd/internal/testenv/apiserver"
	"github.com/mpnbd/mpnbd/pkg/driver"
)

// Admission policies that keep each node's ServiceAccounts to their own
// node's objects (deploy/rbac-node.yaml, deploy/rbac-storage-agent.yaml).
const (
	nodePolicy       = "mpnbd-node-own-attachment"
	agentPolicy      = "mpnbd-storage-agent-own-node"
	agentLeasePolicy = "mpnbd-storage-agent-own-lease"
)

// podTokenClient runs a pod of the ServiceAccount account on node and
// returns a client holding a token bound to that pod, as the kubelet gives
// it (the API server adds the pod's node to the token), and the node name
// the API server sees in it.
func podTokenClient(t *testing.T, cfg *rest.Config, c client.Client, account, node string) (client.Client, string) {
	t.Helper()
	cs, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: account + "-" + node, Namespace: apiserver.DeployNamespace},
		Spec: corev1.PodSpec{NodeName: node, ServiceAccountName: account,
			Containers: []corev1.Container{{Name: "c", Image: "mpnbd:test"}}},
	}
	switch err := c.Create(ctx, pod); {
	case apierrors.IsAlreadyExists(err):
		// Made by an earlier test: its token is as good.
		if err := c.Get(ctx, client.ObjectKeyFromObject(pod), pod); err != nil {
			t.Fatal(err)
		}
	case err != nil:
		t.Fatal(err)
	}
	tr, err := cs.CoreV1().ServiceAccounts(apiserver.DeployNamespace).CreateToken(ctx, account, &authenticationv1.TokenRequest{
		Spec: authenticationv1.TokenRequestSpec{
			ExpirationSeconds: ptr.To[int64](3600),
			BoundObjectRef:    &authenticationv1.BoundObjectReference{Kind: "Pod", APIVersion: "v1", Name: pod.Name, UID: pod.UID},
		},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("a token for pod %s: %v", pod.Name, err)
	}
	return tokenClient(t, cfg, c, tr.Status.Token)
}

// tokenClient returns a client of the API server of cfg that presents
// token, and the node name the API server finds in it ("" for none).
func tokenClient(t *testing.T, cfg *rest.Config, c client.Client, token string) (client.Client, string) {
	t.Helper()
	tc := rest.AnonymousClientConfig(cfg)
	tc.BearerToken = token
	cl, err := client.New(tc, client.Options{Scheme: c.Scheme()})
	if err != nil {
		t.Fatal(err)
	}
	cs, err := kubernetes.NewForConfig(tc)
	if err != nil {
		t.Fatal(err)
	}
	r, err := cs.AuthenticationV1().SelfSubjectReviews().Create(context.Background(), &authenticationv1.SelfSubjectReview{}, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("who the token is: %v", err)
	}
	nodes := r.Status.UserInfo.Extra["authentication.kubernetes.io/node-name"]
	if len(nodes) != 1 {
		return cl, ""
	}
	return cl, nodes[0]
}

// volumeWritesOnlyOfOwnNode acts as the node plugin and the storage agent
// with the tokens the kubelet gives their pods on node-a (a TokenRequest
// bound to the pod, which carries the pod's node): the node plugin writes
// its own entry of a volume's status.attachments and nothing else of any
// volume's status; the storage agent keeps the finalizer and status of
// the volumes and snapshots stored on node-a and the NBDStorageNode of
// node-a, and changes no spec and nothing of node-b's.
func volumeWritesOnlyOfOwnNode(t *testing.T, cfg *rest.Config, c client.Client) {
	ctx := context.Background()
	cs, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	plugin, pluginNode := podTokenClient(t, cfg, c, "mpnbd-node", "node-a")
	agent, agentNode := podTokenClient(t, cfg, c, "mpnbd-storage-agent", "node-a")
	if pluginNode != "node-a" || agentNode != "node-a" {
		t.Fatalf("the API server sees the nodes %q and %q in the pods' tokens, want node-a "+
			"(Kubernetes 1.30 or later puts the node of the pod a token is bound to in it)", pluginNode, agentNode)
	}

	// Volumes stored on node-a and node-b, each attached to node-b,
	// and a snapshot of each; vol-c (on node-b) is the probe that shows
	// the policies in force.
	for _, n := range []string{"a", "b", "c"} {
		node := "node-" + n
		if n == "c" {
			node = "node-b"
		}
		v := &v1alpha1.NBDVolume{
			ObjectMeta: metav1.ObjectMeta{Name: "vol-" + n},
			Spec: v1alpha1.NBDVolumeSpec{SizeBytes: 1 << 30, StorageNode: node, AccessType: v1alpha1.AccessBlock,
				Publications: []v1alpha1.Publication{{NodeID: "node-b", Addresses: []string{"10.0.0.2"}}}},
		}
		if err := c.Create(ctx, v); err != nil {
			t.Fatal(err)
		}
		v.Status = v1alpha1.NBDVolumeStatus{Phase: v1alpha1.VolumeAvailable, CapacityBytes: 1 << 30,
			Export: &v1alpha1.Export{Name: v.Name, Port: 10809, Addresses: []string{"10.0.0.9"}}}
		if err := c.Status().Update(ctx, v); err != nil {
			t.Fatal(err)
		}
		err := (&driver.KubeAttachmentStatus{Client: c, NodeID: "node-b"}).Apply(ctx, v.Name,
			v1alpha1.NodeAttachment{Transport: "relay", Connected: true, LastUpdateTime: metav1.Now()})
		if err != nil {
			t.Fatal(err)
		}
		s := &v1alpha1.NBDSnapshot{ObjectMeta: metav1.ObjectMeta{Name: "snap-" + n},
			Spec: v1alpha1.NBDSnapshotSpec{SourceVolume: v.Name, StorageNode: node}}
		if err := c.Create(ctx, s); err != nil {
			t.Fatal(err)
		}
	}
	if err := c.Create(ctx, &v1alpha1.NBDStorageNode{ObjectMeta: metav1.ObjectMeta{Name: "node-b"}}); err != nil {
		t.Fatal(err)
	}

	statusPatch := func(cl client.Client, obj client.Object, status map[string]any) error {
		b, err := json.Marshal(map[string]any{"status": status})
		if err != nil {
			t.Fatal(err)
		}
		return cl.Status().Patch(ctx, obj, client.RawPatch(types.MergePatchType, b))
	}
	volume := func(name string) *v1alpha1.NBDVolume {
		var v v1alpha1.NBDVolume
		if err := c.Get(ctx, client.ObjectKey{Name: name}, &v); err != nil {
			t.Fatal(err)
		}
		return &v
	}
	// finalizer adds or removes the agent's finalizer as the agent does.
	finalizer := func(cl client.Client, name string, add bool) error {
		v := volume(name)
		patch := client.MergeFromWithOptions(v.DeepCopy(), client.MergeFromWithOptimisticLock{})
		if add {
			controllerutil.AddFinalizer(v, v1alpha1.Finalizer)
		} else {
			controllerutil.RemoveFinalizer(v, v1alpha1.Finalizer)
		}
		return cl.Patch(ctx, v, patch)
	}
	// publishTo adds a publication to node as a full update.
	publishTo := func(cl client.Client, name, node string) error {
		v := volume(name)
		v.Spec.Publications = append(v.Spec.Publications, v1alpha1.Publication{NodeID: node, Addresses: []string{"10.6.6.6"}})
		return cl.Update(ctx, v)
	}
	entry := v1alpha1.NodeAttachment{Transport: "fuse", Connected: true, LastUpdateTime: metav1.Now()}
	refusedBy := func(policy string, err error) string {
		switch {
		case err == nil:
			return "allowed"
		case !strings.Contains(err.Error(), policy):
			return fmt.Sprintf("refused, but not by %s: %v", policy, err)
		case strings.Contains(err.Error(), "resulted in error"):
			// failurePolicy Fail: an expression that cannot be
			// evaluated refuses everything it is asked about.
			return fmt.Sprintf("refused by an expression that failed: %v", err)
		}
		return ""
	}

	// The policies take effect once the API server has loaded them.
	volC := &v1alpha1.NBDVolume{ObjectMeta: metav1.ObjectMeta{Name: "vol-c"}}
	deadline := time.Now().Add(30 * time.Second)
	for i := 0; ; i++ {
		// A new message each time: a write that changes nothing passes.
		msgs := []string{
			refusedBy(nodePolicy, statusPatch(plugin, volC, map[string]any{"phase": "Failed", "message": fmt.Sprint("plugin ", i)})),
			refusedBy(agentPolicy, statusPatch(agent, volC, map[string]any{"phase": "Failed", "message": fmt.Sprint("agent ", i)})),
		}
		if msgs[0] == "" && msgs[1] == "" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("after 30 s, node-a's plugin failing vol-c (stored on node-b): %s; "+
				"node-a's agent failing it: %s", msgs[0], msgs[1])
		}
		time.Sleep(200 * time.Millisecond)
	}

	nodeA := &driver.KubeAttachmentStatus{Client: plugin, NodeID: "node-a"}
	asNodeB := &driver.KubeAttachmentStatus{Client: plugin, NodeID: "node-b"}
	volB := &v1alpha1.NBDVolume{ObjectMeta: metav1.ObjectMeta{Name: "vol-b"}}
	volA := &v1alpha1.NBDVolume{ObjectMeta: metav1.ObjectMeta{Name: "vol-a"}}
	for _, tc := range []struct {
		what    string
		do      func() error
		refused string // the policy that refuses it; "" allowed
	}{
		{"node-a's plugin writing its entry of vol-b", func() error { return nodeA.Apply(ctx, "vol-b", entry) }, ""},
		{"node-a's plugin writing node-b's entry of vol-b", func() error { return asNodeB.Apply(ctx, "vol-b", entry) }, nodePolicy},
		{"node-a's plugin removing node-b's entry of vol-b", func() error { return asNodeB.Remove(ctx, "vol-b") }, nodePolicy},
		{"node-a's plugin changing vol-b's export addresses", func() error {
			return statusPatch(plugin, volB, map[string]any{"export": map[string]any{"name": "vol-b", "port": 10809, "addresses": []string{"10.6.6.6"}}})
		}, nodePolicy},
		{"node-a's plugin adding a condition to vol-b", func() error {
			return statusPatch(plugin, volB, map[string]any{"conditions": []any{map[string]any{"type": "Ready", "status": "False",
				"reason": "X", "message": "x", "lastTransitionTime": "2026-01-01T00:00:00Z"}}})
		}, nodePolicy},
		{"node-a's plugin removing its entry of vol-b", func() error { return nodeA.Remove(ctx, "vol-b") }, ""},

		{"node-a's agent adding its finalizer to vol-a", func() error { return finalizer(agent, "vol-a", true) }, ""},
		{"node-a's agent writing vol-a's status", func() error {
			return statusPatch(agent, volA, map[string]any{"phase": "Failed", "code": "Internal", "message": "x",
				"export": map[string]any{"name": "vol-a", "port": 10809, "addresses": []string{"10.0.0.1"}}})
		}, ""},
		{"node-a's agent removing its finalizer from vol-a", func() error { return finalizer(agent, "vol-a", false) }, ""},
		{"node-a's agent publishing vol-b to node-a", func() error { return publishTo(agent, "vol-b", "node-a") }, agentPolicy},
		{"node-a's agent moving vol-b to node-a", func() error {
			v := volume("vol-b")
			v.Spec.StorageNode = "node-a"
			return agent.Update(ctx, v)
		}, agentPolicy},
		{"node-a's agent adding its finalizer to vol-b", func() error { return finalizer(agent, "vol-b", true) }, agentPolicy},
		{"node-a's agent changing vol-b's export addresses", func() error {
			return statusPatch(agent, volB, map[string]any{"export": map[string]any{"name": "vol-b", "port": 10809, "addresses": []string{"10.6.6.6"}}})
		}, agentPolicy},
		{"node-a's agent publishing vol-a to node-a", func() error { return publishTo(agent, "vol-a", "node-a") }, agentPolicy},
		{"node-a's agent labelling vol-a", func() error {
			return agent.Patch(ctx, volA, client.RawPatch(types.MergePatchType, []byte(`{"metadata":{"labels":{"x":"y"}}}`)))
		}, agentPolicy},
		{"node-a's agent removing node-b's entry of vol-a", func() error {
			return statusPatch(agent, volA, map[string]any{"attachments": nil})
		}, agentPolicy},

		{"node-a's agent writing snap-a's status", func() error {
			return statusPatch(agent, &v1alpha1.NBDSnapshot{ObjectMeta: metav1.ObjectMeta{Name: "snap-a"}},
				map[string]any{"code": "NotFound", "message": "x"})
		}, ""},
		{"node-a's agent marking snap-b ready", func() error {
			return statusPatch(agent, &v1alpha1.NBDSnapshot{ObjectMeta: metav1.ObjectMeta{Name: "snap-b"}},
				map[string]any{"readyToUse": true, "sizeBytes": 1})
		}, agentPolicy},
		{"node-a's agent creating its NBDStorageNode", func() error {
			return agent.Create(ctx, &v1alpha1.NBDStorageNode{ObjectMeta: metav1.ObjectMeta{Name: "node-a"}})
		}, ""},
		{"node-a's agent reporting its capacity", func() error {
			return statusPatch(agent, &v1alpha1.NBDStorageNode{ObjectMeta: metav1.ObjectMeta{Name: "node-a"}},
				map[string]any{"availableBytes": 1 << 30, "capacityBytes": 1 << 31, "port": 10809, "heartbeat": "2026-01-01T00:00:00Z"})
		}, ""},
		{"node-a's agent reporting node-b's capacity", func() error {
			return statusPatch(agent, &v1alpha1.NBDStorageNode{ObjectMeta: metav1.ObjectMeta{Name: "node-b"}},
				map[string]any{"availableBytes": 0, "capacityBytes": 1, "port": 10809, "heartbeat": "2026-01-01T00:00:00Z"})
		}, agentPolicy},
		{"node-a's agent creating an NBDStorageNode of node-c", func() error {
			return agent.Create(ctx, &v1alpha1.NBDStorageNode{ObjectMeta: metav1.ObjectMeta{Name: "node-c"}})
		}, agentPolicy},
		{"the administrator cordoning and draining node-a", func() error {
			return c.Patch(ctx, &v1alpha1.NBDStorageNode{ObjectMeta: metav1.ObjectMeta{Name: "node-a"}},
				client.RawPatch(types.MergePatchType, []byte(`{"spec":{"unschedulable":true,"drain":true}}`)))
		}, ""},
		{"node-a's agent uncordoning its NBDStorageNode", func() error {
			return agent.Patch(ctx, &v1alpha1.NBDStorageNode{ObjectMeta: metav1.ObjectMeta{Name: "node-a"}},
				client.RawPatch(types.MergePatchType, []byte(`{"spec":{"unschedulable":false}}`)))
		}, agentPolicy},
		{"node-a's agent stopping its NBDStorageNode's drain", func() error {
			return agent.Patch(ctx, &v1alpha1.NBDStorageNode{ObjectMeta: metav1.ObjectMeta{Name: "node-a"}},
				client.RawPatch(types.MergePatchType, []byte(`{"spec":{"drain":null}}`)))
		}, agentPolicy},
		{"node-a's agent labelling its NBDStorageNode (its spec unchanged)", func() error {
			return agent.Patch(ctx, &v1alpha1.NBDStorageNode{ObjectMeta: metav1.ObjectMeta{Name: "node-a"}},
				client.RawPatch(types.MergePatchType, []byte(`{"metadata":{"labels":{"x":"y"}}}`)))
		}, ""},
	} {
		err := tc.do()
		switch {
		case tc.refused == "" && err != nil:
			t.Errorf("%s: %v", tc.what, err)
		case tc.refused != "":
			if msg := refusedBy(tc.refused, err); msg != "" {
				t.Errorf("%s: %s", tc.what, msg)
			} else {
				t.Logf("%s: refused: %v", tc.what, err)
			}
		}
	}

	// What was refused left node-a cordoned and draining.
	var na v1alpha1.NBDStorageNode
	if err := c.Get(ctx, client.ObjectKey{Name: "node-a"}, &na); err != nil || !na.Spec.Unschedulable || !na.Spec.Drain {
		t.Errorf("node-a after its agent's refused writes: spec %+v, %v", na.Spec, err)
	}

	// What was refused left node-b's volume as it was.
	v := volume("vol-b")
	if len(v.Spec.Publications) != 1 || v.Spec.StorageNode != "node-b" || v.Status.Phase != v1alpha1.VolumeAvailable ||
		v.Status.Export == nil || v.Status.Export.Addresses[0] != "10.0.0.9" ||
		len(v.Status.Attachments) != 1 || v.Status.Attachments[0].NodeID != "node-b" || v.Status.Attachments[0].Transport != "relay" {
		t.Errorf("vol-b after the refused writes: spec %+v, status %+v", v.Spec, v.Status)
	}

	// A token that names no node (one bound to no pod) writes nothing.
	for _, account := range []string{"mpnbd-node", "mpnbd-storage-agent"} {
		tr, err := cs.CoreV1().ServiceAccounts(apiserver.DeployNamespace).CreateToken(ctx, account,
			&authenticationv1.TokenRequest{Spec: authenticationv1.TokenRequestSpec{ExpirationSeconds: ptr.To[int64](3600)}}, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		cl, node := tokenClient(t, cfg, c, tr.Status.Token)
		if node != "" {
			t.Fatalf("a token bound to no pod names node %q", node)
		}
		var err2 error
		policy := nodePolicy
		if account == "mpnbd-node" {
			err2 = (&driver.KubeAttachmentStatus{Client: cl, NodeID: "node-a"}).Apply(ctx, "vol-b", entry)
		} else {
			policy = agentPolicy
			err2 = statusPatch(cl, volA, map[string]any{"phase": "Available"})
		}
		if msg := refusedBy(policy, err2); msg != "" {
			t.Errorf("%s without a node in its token: %s", account, msg)
		}
	}
}

// replicaWritesOfOwnNode acts as node-a's storage agent on replicated
// volumes (docs/replication.md): of a volume it holds a replica of, it
// may add and remove its own replica finalizer and nothing else; of a
// volume whose primary it is, it may make the replication record and
// then only drop one replica from the in-sync set or bring one of the
// volume's replicas back, each raising the epoch by one; it never makes
// another node primary, and writes nothing of a volume whose record
// names another primary.
func replicaWritesOfOwnNode(t *testing.T, cfg *rest.Config, c client.Client) {
	ctx := context.Background()
	agent, agentNode := podTokenClient(t, cfg, c, "mpnbd-storage-agent", "node-a")
	if agentNode != "node-a" {
		t.Fatalf("the API server sees node %q in the pod's token, want node-a", agentNode)
	}
	type record struct {
		epoch   int64
		primary string
		inSync  []string
	}
	// primaryEpoch is when each volume's recorded primary became it.
	primaryEpoch := map[string]int64{"vol-r": 1, "vol-p": 2, "vol-q": 1, "vol-m": 2}
	recFor := func(vol string, r record) map[string]any {
		return map[string]any{"epoch": r.epoch, "primary": r.primary, "primaryEpoch": primaryEpoch[vol],
			"inSync": r.inSync, "inSyncReplicas": len(r.inSync)}
	}
	// vol-r: stored on node-b, with replicas on node-a and node-c;
	// vol-p: node-a its primary, replicas on node-b and node-c;
	// vol-q: node-a's, a replica on node-b, no record yet;
	// vol-m: node-a's spec, but a record naming node-b primary (a
	// promotion the controller has recorded and not yet moved); vol-x:
	// node-b's, its replica moved from node-a to node-c.
	for _, v := range []struct {
		name, node string
		replicas   []string
		rec        *record
	}{
		{"vol-r", "node-b", []string{"node-a", "node-c"}, &record{3, "node-b", []string{"node-a", "node-b", "node-c"}}},
		{"vol-p", "node-a", []string{"node-b", "node-c"}, &record{5, "node-a", []string{"node-a", "node-b", "node-c"}}},
		{"vol-q", "node-a", []string{"node-b"}, nil},
		{"vol-m", "node-a", []string{"node-b"}, &record{2, "node-b", []string{"node-a", "node-b"}}},
		{"vol-x", "node-b", []string{"node-c"}, nil},
	} {
		vol := &v1alpha1.NBDVolume{
			ObjectMeta: metav1.ObjectMeta{Name: v.name},
			Spec: v1alpha1.NBDVolumeSpec{SizeBytes: 1 << 30, StorageNode: v.node, AccessType: v1alpha1.AccessBlock,
				Replicas: int32(1 + len(v.replicas)), ReplicaNodes: v.replicas},
		}
		if v.name == "vol-x" {
			// Its replica moved from node-a to node-c: node-a's agent
			// still holds its finalizer.
			vol.Finalizers = []string{v1alpha1.ReplicaFinalizer("node-a")}
		}
		if err := c.Create(ctx, vol); err != nil {
			t.Fatal(err)
		}
		vol.Status = v1alpha1.NBDVolumeStatus{Phase: v1alpha1.VolumeAvailable, CapacityBytes: 1 << 30}
		if v.rec != nil {
			vol.Status.Replication = &v1alpha1.ReplicationStatus{Epoch: v.rec.epoch, Primary: v.rec.primary,
				PrimaryEpoch: primaryEpoch[v.name], InSync: v.rec.inSync, InSyncReplicas: int32(len(v.rec.inSync))}
		}
		if err := c.Status().Update(ctx, vol); err != nil {
			t.Fatal(err)
		}
	}
	obj := func(name string) *v1alpha1.NBDVolume {
		return &v1alpha1.NBDVolume{ObjectMeta: metav1.ObjectMeta{Name: name}}
	}
	statusPatch := func(name string, status map[string]any) error {
		b, err := json.Marshal(map[string]any{"status": status})
		if err != nil {
			t.Fatal(err)
		}
		return agent.Status().Patch(ctx, obj(name), client.RawPatch(types.MergePatchType, b))
	}
	replication := func(name string, r record) func() error {
		return func() error { return statusPatch(name, map[string]any{"replication": recFor(name, r)}) }
	}
	// finalizer adds or removes finalizer f as the agent does.
	finalizer := func(name, f string, add bool) func() error {
		return func() error {
			var v v1alpha1.NBDVolume
			if err := c.Get(ctx, client.ObjectKey{Name: name}, &v); err != nil {
				t.Fatal(err)
			}
			patch := client.MergeFromWithOptions(v.DeepCopy(), client.MergeFromWithOptimisticLock{})
			if add {
				controllerutil.AddFinalizer(&v, f)
			} else {
				controllerutil.RemoveFinalizer(&v, f)
			}
			return agent.Patch(ctx, &v, patch)
		}
	}
	mine, nodeC := v1alpha1.ReplicaFinalizer("node-a"), v1alpha1.ReplicaFinalizer("node-c")
	a, b, cc := "node-a", "node-b", "node-c"
	for _, tc := range []struct {
		what    string
		do      func() error
		refused bool
	}{
		{"adding its replica finalizer to vol-r, of which it holds a replica", finalizer("vol-r", mine, true), false},
		{"adding node-c's replica finalizer to vol-r", finalizer("vol-r", nodeC, true), true},
		{"adding the primary's finalizer to vol-r", finalizer("vol-r", v1alpha1.Finalizer, true), true},
		{"writing the status of vol-r, of which it holds a replica", func() error { return statusPatch("vol-r", map[string]any{"message": "x"}) }, true},
		{"dropping node-c from vol-r's in-sync set, not its primary", replication("vol-r", record{4, b, []string{a, b}}), true},
		{"labelling vol-r", func() error {
			return agent.Patch(ctx, obj("vol-r"), client.RawPatch(types.MergePatchType, []byte(`{"metadata":{"labels":{"x":"y"}}}`)))
		}, true},
		{"removing its replica finalizer from vol-r", finalizer("vol-r", mine, false), false},
		{"adding a replica finalizer to vol-b, of which it holds none", finalizer("vol-b", mine, true), true},

		{"adding the primary's finalizer to vol-x, whose replica moved away from it", finalizer("vol-x", v1alpha1.Finalizer, true), true},
		{"removing its replica finalizer from vol-x, whose replica moved away from it", finalizer("vol-x", mine, false), false},
		{"adding its replica finalizer back to vol-x", finalizer("vol-x", mine, true), true},

		{"making vol-q's record, itself primary", replication("vol-q", record{1, a, []string{a, b}}), false},
		{"dropping node-b from vol-q's in-sync set", replication("vol-q", record{2, a, []string{a}}), false},
		{"bringing node-x, no replica of vol-q, into its in-sync set", replication("vol-q", record{3, a, []string{a, "node-x"}}), true},

		{"dropping two replicas of vol-p at once", replication("vol-p", record{6, a, []string{a}}), true},
		{"dropping node-b from vol-p's in-sync set", replication("vol-p", record{6, a, []string{a, cc}}), false},
		{"dropping node-c from vol-p, skipping an epoch", replication("vol-p", record{8, a, []string{a}}), true},
		{"dropping node-c from vol-p, the epoch kept", replication("vol-p", record{6, a, []string{a}}), true},
		{"making node-c vol-p's primary", replication("vol-p", record{7, cc, []string{a, cc}}), true},
		{"dropping itself from vol-p's in-sync set", replication("vol-p", record{7, a, []string{cc}}), true},
		{"miscounting vol-p's in-sync replicas", func() error {
			r := recFor("vol-p", record{7, a, []string{a}})
			r["inSyncReplicas"] = 2
			return statusPatch("vol-p", map[string]any{"replication": r})
		}, true},
		{"moving vol-p's primary epoch", func() error {
			r := recFor("vol-p", record{7, a, []string{a}})
			r["primaryEpoch"] = 7
			return statusPatch("vol-p", map[string]any{"replication": r})
		}, true},
		{"removing vol-p's record", func() error { return statusPatch("vol-p", map[string]any{"replication": nil}) }, true},
		{"writing vol-p's phase, its record kept", func() error { return statusPatch("vol-p", map[string]any{"message": "y"}) }, false},
		{"bringing node-b back into vol-p's in-sync set", replication("vol-p", record{7, a, []string{a, b, cc}}), false},

		{"dropping node-b from vol-m, whose record names node-b primary", replication("vol-m", record{3, a, []string{a}}), true},
	} {
		checkWrite(t, "node-a's agent "+tc.what, tc.do(), tc.refused, agentPolicy)
	}
	var p v1alpha1.NBDVolume
	if err := c.Get(ctx, client.ObjectKey{Name: "vol-p"}, &p); err != nil {
		t.Fatal(err)
	}
	if r := p.Status.Replication; r == nil || r.Epoch != 7 || r.Primary != a || !slices.Equal(r.InSync, []string{a, b, cc}) {
		t.Errorf("vol-p's record after the writes: %+v", r)
	}
}
