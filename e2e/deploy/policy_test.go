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
	"strings"
	"testing"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/rest"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/mpnbd/mpnbd/api/v1alpha1"
	"github.com/mpnbd/mpnbd/internal/testenv/apiserver"
	"github.com/mpnbd/mpnbd/pkg/access"
	"github.com/mpnbd/mpnbd/pkg/driver"
)

// TestNodePolicies applies the RBAC and admission policies of the node
// plugin and the storage agent of the kustomize tree to a real API server
// with the Nodes node-a and node-b, and checks what each may write.
func TestNodePolicies(t *testing.T) {
	cfg, c := apiserver.Start(t)
	ctx := context.Background()
	if err := c.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: apiserver.DeployNamespace}}); err != nil {
		t.Fatal(err)
	}
	applied := map[string]int{}
	for _, o := range parseObjects(t, kustomizeDeploy(t)) {
		switch o.GetKind() {
		case "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding", "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding":
		default:
			continue
		}
		comp := o.GetLabels()["app.kubernetes.io/component"]
		if comp != "node" && comp != "storage-agent" {
			continue
		}
		if err := c.Create(ctx, o); err != nil {
			t.Fatalf("%s: %v", objectKey(o), err)
		}
		applied[o.GetKind()]++
	}
	// Each: a ServiceAccount, a ClusterRole and its binding; the node
	// plugin two policies, the storage agent two (its node's objects, its
	// node's lease).
	if applied["ServiceAccount"] != 2 || applied["ClusterRoleBinding"] != 2 || applied["ValidatingAdmissionPolicy"] != 4 ||
		applied["ValidatingAdmissionPolicyBinding"] != 4 {
		t.Fatalf("applied %v of the node plugin's and the storage agent's RBAC and policies", applied)
	}
	for _, n := range []string{"node-a", "node-b"} {
		node := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: n, Labels: map[string]string{"zone": "a"},
			Annotations: map[string]string{"other": "x"}}}
		if err := c.Create(ctx, node); err != nil {
			t.Fatal(err)
		}
	}
	t.Run("NodeAnnotation", func(t *testing.T) { nodePluginMayAnnotateOnlyItsNode(t, cfg, c) })
	t.Run("VolumeWrites", func(t *testing.T) { volumeWritesOnlyOfOwnNode(t, cfg, c) })
	t.Run("ReplicaWrites", func(t *testing.T) { replicaWritesOfOwnNode(t, cfg, c) })
	t.Run("LeaseWrites", func(t *testing.T) { leaseWritesOfOwnNode(t, cfg, c) })
}

// leaseWritesOfOwnNode acts as node-a's storage agent: it may create and
// renew its node's lease, held by its node, and no other lease: not
// node-b's (which would hide node-b's death from the failover), not its
// own held by another, and it may delete none.
func leaseWritesOfOwnNode(t *testing.T, cfg *rest.Config, c client.Client) {
	ctx := context.Background()
	agent, _ := podTokenClient(t, cfg, c, "mpnbd-storage-agent", "node-a")
	lease := func(node, holder string) *coordinationv1.Lease {
		now := metav1.NowMicro()
		return &coordinationv1.Lease{
			ObjectMeta: metav1.ObjectMeta{Namespace: apiserver.DeployNamespace, Name: v1alpha1.StorageLeaseName(node)},
			Spec:       coordinationv1.LeaseSpec{HolderIdentity: ptr.To(holder), LeaseDurationSeconds: ptr.To[int32](6), RenewTime: &now},
		}
	}
	// node-b's lease, as its own agent made it.
	if err := c.Create(ctx, lease("node-b", "node-b")); err != nil {
		t.Fatal(err)
	}
	renew := func(node, holder string) func() error {
		return func() error {
			var l coordinationv1.Lease
			if err := c.Get(ctx, client.ObjectKeyFromObject(lease(node, holder)), &l); err != nil {
				t.Fatal(err)
			}
			l.Spec = lease(node, holder).Spec
			return agent.Update(ctx, &l)
		}
	}
	// The policy takes effect once the API server has loaded it.
	deadline := time.Now().Add(30 * time.Second)
	for {
		err := renew("node-b", "node-b")()
		if err != nil && strings.Contains(err.Error(), agentLeasePolicy) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("node-a's agent renewing node-b's lease, 30 s after the policy was made: %v", err)
		}
		time.Sleep(200 * time.Millisecond)
	}
	for _, tc := range []struct {
		what    string
		do      func() error
		refused bool
		policy  bool // refused by the policy (else by RBAC)
	}{
		{"creating its node's lease", func() error { return agent.Create(ctx, lease("node-a", "node-a")) }, false, false},
		{"renewing its node's lease", renew("node-a", "node-a"), false, false},
		{"renewing node-b's lease", renew("node-b", "node-b"), true, true},
		{"creating a lease of node-c", func() error { return agent.Create(ctx, lease("node-c", "node-c")) }, true, true},
		{"creating a lease named for node-c, held by itself", func() error { return agent.Create(ctx, lease("node-c", "node-a")) }, true, true},
		{"giving its node's lease to node-b", renew("node-a", "node-b"), true, true},
		{"deleting its node's lease", func() error { return agent.Delete(ctx, lease("node-a", "node-a")) }, true, false},
	} {
		policy := ""
		if tc.policy {
			policy = agentLeasePolicy
		}
		checkWrite(t, "node-a's agent "+tc.what, tc.do(), tc.refused, policy)
	}
}

// checkWrite checks the outcome err of a write that what describes: it
// succeeded, or it was refused, when refused, by policy (any refusal
// when policy is empty), and not by an expression that failed to
// evaluate.
func checkWrite(t *testing.T, what string, err error, refused bool, policy string) {
	t.Helper()
	switch {
	case !refused && err != nil:
		t.Errorf("%s: %v", what, err)
	case refused && err == nil:
		t.Errorf("%s: allowed", what)
	case refused && policy != "" && !strings.Contains(err.Error(), policy):
		t.Errorf("%s: refused, but not by %s: %v", what, policy, err)
	case refused && strings.Contains(err.Error(), "resulted in error"):
		t.Errorf("%s: refused by an expression that failed: %v", what, err)
	case refused:
		t.Logf("%s: refused: %v", what, err)
	}
}

// nodePluginMayAnnotateOnlyItsNode acts as the node plugin's
// ServiceAccount of node-a (impersonated, with the node-name its pod's
// token carries): it may publish its storage addresses on node-a, and
// nothing else: not on node-b, not another annotation, not a label, not
// without a node name.
func nodePluginMayAnnotateOnlyItsNode(t *testing.T, cfg *rest.Config, c client.Client) {
	ctx := context.Background()
	as := func(nodeName string) client.Client {
		ic := rest.CopyConfig(cfg)
		ic.Impersonate = rest.ImpersonationConfig{
			UserName: "system:serviceaccount:mpnbd-system:mpnbd-node",
			Groups:   []string{"system:serviceaccounts", "system:serviceaccounts:mpnbd-system", "system:authenticated"},
		}
		if nodeName != "" {
			ic.Impersonate.Extra = map[string][]string{"authentication.kubernetes.io/node-name": {nodeName}}
		}
		cl, err := client.New(ic, client.Options{Scheme: c.Scheme()})
		if err != nil {
			t.Fatal(err)
		}
		return cl
	}
	plugin := as("node-a")
	patch := func(cl client.Client, node string, meta map[string]any) error {
		b, err := json.Marshal(map[string]any{"metadata": meta})
		if err != nil {
			t.Fatal(err)
		}
		n := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: node}}
		return cl.Patch(ctx, n, client.RawPatch(types.MergePatchType, b))
	}
	denied := func(err error) string {
		switch {
		case err == nil:
			return "allowed"
		case !strings.Contains(err.Error(), "mpnbd-node-own-annotation"):
			return fmt.Sprintf("refused, but not by the policy: %v", err)
		}
		return ""
	}

	// The policy takes effect once the API server has loaded it.
	deadline := time.Now().Add(30 * time.Second)
	for {
		msg := denied(driver.PublishStorageAddresses(ctx, plugin, "node-b", []string{"10.0.0.2"}))
		if msg == "" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("node-a's plugin publishing addresses on node-b: %s after 30 s", msg)
		}
		time.Sleep(200 * time.Millisecond)
	}

	if err := driver.PublishStorageAddresses(ctx, plugin, "node-a", []string{"10.0.0.1", "10.0.1.1"}); err != nil {
		t.Fatalf("node-a's plugin publishing its own addresses: %v", err)
	}
	var got corev1.Node
	if err := c.Get(ctx, client.ObjectKey{Name: "node-a"}, &got); err != nil {
		t.Fatal(err)
	}
	if got.Annotations[access.AnnotationStorageAddresses] != "10.0.0.1,10.0.1.1" {
		t.Fatalf("node-a's annotations %v", got.Annotations)
	}
	// Its token's hash too, on its own Node only.
	hash := access.TokenHash("00112233445566778899aabbccddeeff")
	if err := driver.PublishNodeAccess(ctx, plugin, "node-a", []string{"10.0.0.1"}, hash); err != nil {
		t.Fatalf("node-a's plugin publishing its token's hash: %v", err)
	}
	if msg := denied(driver.PublishNodeAccess(ctx, plugin, "node-b", []string{"10.0.0.1"}, hash)); msg != "" {
		t.Errorf("node-a's plugin publishing its token's hash on node-b: %s", msg)
	}
	for _, c := range []struct {
		what string
		err  error
	}{
		{"another annotation of its node", patch(plugin, "node-a", map[string]any{"annotations": map[string]any{"other": "y"}})},
		{"removing another annotation", patch(plugin, "node-a", map[string]any{"annotations": map[string]any{"other": nil}})},
		{"a label of its node", patch(plugin, "node-a", map[string]any{"labels": map[string]any{"zone": "b"}})},
		{"its addresses without a node name in its token", driver.PublishStorageAddresses(ctx, as(""), "node-a", []string{"10.0.0.9"})},
	} {
		if msg := denied(c.err); msg != "" {
			t.Errorf("node-a's plugin changing %s: %s", c.what, msg)
		}
	}
	// Others are not the policy's business.
	if err := patch(c, "node-b", map[string]any{"labels": map[string]any{"zone": "b"}}); err != nil {
		t.Errorf("an administrator labelling node-b: %v", err)
	}
}
