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

package cluster

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	authenticationv1 "k8s.io/api/authentication/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/util/retry"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/mpnbd/mpnbd/api/v1alpha1"
	"github.com/mpnbd/mpnbd/pkg/driver"
)

// The admission policies that keep the node plugin and the storage agent
// to their own node's entries and objects (charts/mpnbd/templates/rbac-node.yaml
// and rbac-storage-agent.yaml).
const (
	nodeAttachmentPolicy = "mpnbd-node-own-attachment"
	agentOwnNodePolicy   = "mpnbd-storage-agent-own-node"
)

// envTokensOnly, set to anything, runs the token scenario (tokenScenario)
// right after the upgrade to this chart and the issuing of the node's
// certificates, and uninstalls the driver (the other scenarios are
// skipped).
const envTokensOnly = "MPNBD_CLUSTER_TOKENS_ONLY"

// apiCallTimeout bounds each request the suite makes with a pod's token.
const apiCallTimeout = 15 * time.Second

// podCredentials is what the kubelet mounted into a running pod of the
// driver: its ServiceAccount token and the API server's CA.
type podCredentials struct {
	pod, uid  string
	token, ca []byte
}

// mountedToken finds the running pod of component (the chart's
// app.kubernetes.io/component) on the suite's node and reads the token
// and CA the kubelet projected into it, from the kubelet's root on the
// host: <root>/pods/<pod UID>/volumes/kubernetes.io~projected/<name>/.
func (s *suite) mountedToken(component string) podCredentials {
	s.t.Helper()
	var pc podCredentials
	s.waitFor("the token the kubelet mounted into the "+component+" pod", 30*time.Second, func() string {
		out, err := s.c.Kubectl(s.ctx, "get", "pods", "-n", namespace, "-l", "app.kubernetes.io/component="+component, "-o", "json")
		if err != nil {
			return err.Error()
		}
		var l struct {
			Items []struct {
				Metadata struct {
					Name              string
					UID               string
					DeletionTimestamp *string
				}
				Spec   struct{ NodeName string }
				Status struct{ Phase string }
			}
		}
		if err := json.Unmarshal([]byte(out), &l); err != nil {
			return err.Error()
		}
		var running []string
		for _, p := range l.Items {
			if p.Spec.NodeName == s.c.NodeName && p.Status.Phase == "Running" && p.Metadata.DeletionTimestamp == nil {
				running = append(running, p.Metadata.Name)
				pc.pod, pc.uid = p.Metadata.Name, p.Metadata.UID
			}
		}
		if len(running) != 1 {
			return fmt.Sprintf("running %s pods on %s: %v, want one", component, s.c.NodeName, running)
		}
		vols := filepath.Join(s.c.KubeletRoot(), "pods", pc.uid, "volumes", "kubernetes.io~projected")
		tokens, err := filepath.Glob(filepath.Join(vols, "*", "token"))
		if err != nil {
			return err.Error()
		}
		var found []string
		for _, tf := range tokens {
			ca, err := os.ReadFile(filepath.Join(filepath.Dir(tf), "ca.crt"))
			if err != nil {
				continue // a projected volume of another kind
			}
			tok, err := os.ReadFile(tf)
			if err != nil {
				return err.Error()
			}
			found = append(found, tf)
			pc.token, pc.ca = []byte(strings.TrimSpace(string(tok))), ca
		}
		if len(found) != 1 {
			return fmt.Sprintf("ServiceAccount tokens (with ca.crt) of pod %s under %s: %v, want one", pc.pod, vols, found)
		}
		return ""
	})
	return pc
}

// tokenClient is a client of the suite's API server holding nothing but
// its address, the CA and the pod's token (no admin credentials). It
// checks that the API server takes the token for account's pod pc on the
// suite's node: the node name is what the admission policies go by.
func (s *suite) tokenClient(pc podCredentials, account string) client.Client {
	s.t.Helper()
	c, u, err := tokenClient(s.ctx, fmt.Sprintf("https://127.0.0.1:%d", APIServerPort), pc.ca, pc.token)
	if err != nil {
		s.t.Fatalf("the token mounted into pod %s: %v", pc.pod, err)
	}
	want := "system:serviceaccount:" + namespace + ":" + account
	if u.Username != want || !slices.Equal(u.Extra["authentication.kubernetes.io/node-name"], []string{s.c.NodeName}) ||
		!slices.Equal(u.Extra["authentication.kubernetes.io/pod-uid"], []string{pc.uid}) {
		s.t.Fatalf("the token mounted into pod %s is %q with %v; want %s bound to the pod (uid %s) on node %s",
			pc.pod, u.Username, u.Extra, want, pc.uid, s.c.NodeName)
	}
	return c
}

// tokenClient is a client of the API server at host (whose certificate
// ca verifies) that presents token and nothing else, and who the API
// server takes the token for.
func tokenClient(ctx context.Context, host string, ca, token []byte) (client.Client, authenticationv1.UserInfo, error) {
	cfg := &rest.Config{
		Host:            host,
		BearerToken:     string(token),
		TLSClientConfig: rest.TLSClientConfig{CAData: ca},
		Timeout:         apiCallTimeout,
	}
	cs, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return nil, authenticationv1.UserInfo{}, err
	}
	ctx, cancel := context.WithTimeout(ctx, apiCallTimeout)
	defer cancel()
	r, err := cs.AuthenticationV1().SelfSubjectReviews().Create(ctx, &authenticationv1.SelfSubjectReview{}, metav1.CreateOptions{})
	if err != nil {
		return nil, authenticationv1.UserInfo{}, fmt.Errorf("who the token is: %w", err)
	}
	sch := runtime.NewScheme()
	if err := v1alpha1.AddToScheme(sch); err != nil {
		return nil, authenticationv1.UserInfo{}, err
	}
	c, err := client.New(cfg, client.Options{Scheme: sch})
	if err != nil {
		return nil, authenticationv1.UserInfo{}, err
	}
	return c, r.Status.UserInfo, nil
}

// refusedBy is "" when err is a refusal by policy, else what it is.
func refusedBy(policy string, err error) string {
	switch {
	case err == nil:
		return "allowed"
	case !strings.Contains(err.Error(), policy):
		return fmt.Sprintf("refused, but not by %s: %v", policy, err)
	case strings.Contains(err.Error(), "resulted in error"):
		// failurePolicy Fail: an expression that cannot be evaluated
		// refuses everything it is asked about.
		return fmt.Sprintf("refused by an expression that failed: %v", err)
	}
	return ""
}

// ownNodeWritesOnly acts, while volume pv (stored on the suite's node and
// published to it) is in use, as the node plugin and as the storage agent
// with the tokens the kubelet mounted into their running pods
// (ownNodeWrites).
func (s *suite) ownNodeWritesOnly(pv string) {
	plugin := s.tokenClient(s.mountedToken("node"), "mpnbd-node")
	agent := s.tokenClient(s.mountedToken("storage-agent"), "mpnbd-storage-agent")
	ownNodeWrites(s.ctx, s.t, s.kubeClient(), plugin, agent, pv, s.c.NodeName)
}

// ownNodeWrites writes volume pv, stored on node and published to it, as
// node's plugin and storage agent (the clients plugin and agent; admin
// reads). The node plugin rewrites its own entry of pv's
// status.attachments, and is refused every other status write: the export
// addresses the next node is sent to, the phase, another node's entry.
// The storage agent may write pv's status (a dry run: the agent's own
// writes are left alone), and is refused every change of its spec (a
// publication to another node, another storage node) and of the node
// plugin's entry. Each refusal must come from the admission policy, not
// from RBAC or a failed expression, and must leave pv as it was.
func ownNodeWrites(ctx context.Context, t *testing.T, admin, plugin, agent client.Client, pv, node string) {
	other := "not-" + node
	volume := func() *v1alpha1.NBDVolume {
		ctx, cancel := context.WithTimeout(ctx, apiCallTimeout)
		defer cancel()
		var v v1alpha1.NBDVolume
		if err := admin.Get(ctx, client.ObjectKey{Name: pv}, &v); err != nil {
			t.Fatalf("NBDVolume %s: %v", pv, err)
		}
		return &v
	}
	var own v1alpha1.NodeAttachment
	for end := time.Now().Add(time.Minute); ; {
		v := volume()
		i := slices.IndexFunc(v.Status.Attachments, func(a v1alpha1.NodeAttachment) bool { return a.NodeID == node })
		if i >= 0 {
			own = v.Status.Attachments[i]
			break
		}
		if time.Now().After(end) {
			t.Fatalf("after a minute, no entry of node %s in the status.attachments of %s: %+v", node, pv, v.Status.Attachments)
		}
		time.Sleep(500 * time.Millisecond)
	}
	before := volume()
	if before.Spec.StorageNode != node || before.Status.Export == nil || len(before.Status.Export.Addresses) == 0 {
		t.Fatalf("NBDVolume %s: storage node %q, export %+v; want one stored on %s and exported", pv, before.Spec.StorageNode, before.Status.Export, node)
	}

	obj := &v1alpha1.NBDVolume{ObjectMeta: metav1.ObjectMeta{Name: pv}}
	statusPatch := func(cl client.Client, status map[string]any, opts ...client.SubResourcePatchOption) error {
		b, err := json.Marshal(map[string]any{"status": status})
		if err != nil {
			t.Fatal(err)
		}
		return cl.Status().Patch(ctx, obj, client.RawPatch(types.MergePatchType, b), opts...)
	}
	// update changes the spec as a full update, as the agent writes
	// its volumes, retried when the volume changed in between (the
	// conflict would hide what admission says).
	update := func(cl client.Client, change func(*v1alpha1.NBDVolumeSpec)) error {
		return retry.RetryOnConflict(retry.DefaultRetry, func() error {
			v := volume()
			change(&v.Spec)
			return cl.Update(ctx, v)
		})
	}
	refreshed := own
	refreshed.LastUpdateTime = metav1.Now()
	for _, tc := range []struct {
		what    string
		do      func() error
		refused string // the policy that refuses it; "" allowed
	}{
		{"the node plugin rewriting its own entry", func() error {
			return (&driver.KubeAttachmentStatus{Client: plugin, NodeID: node}).Apply(ctx, pv, refreshed)
		}, ""},
		{"the node plugin changing the export addresses", func() error {
			return statusPatch(plugin, map[string]any{"export": map[string]any{"addresses": []string{"10.6.6.6"}}})
		}, nodeAttachmentPolicy},
		{"the node plugin failing the volume", func() error {
			return statusPatch(plugin, map[string]any{"phase": "Failed", "message": "set by a node plugin"})
		}, nodeAttachmentPolicy},
		{"the node plugin writing another node's entry", func() error {
			return (&driver.KubeAttachmentStatus{Client: plugin, NodeID: other}).Apply(ctx, pv, own)
		}, nodeAttachmentPolicy},
		{"the storage agent writing the volume's status (dry run)", func() error {
			return statusPatch(agent, map[string]any{"message": "set by the storage agent"}, client.DryRunAll)
		}, ""},
		{"the storage agent publishing the volume to another node", func() error {
			return update(agent, func(sp *v1alpha1.NBDVolumeSpec) {
				sp.Publications = append(sp.Publications, v1alpha1.Publication{NodeID: other, Addresses: []string{"10.6.6.6"}})
			})
		}, agentOwnNodePolicy},
		{"the storage agent moving the volume to another storage node", func() error {
			return update(agent, func(sp *v1alpha1.NBDVolumeSpec) { sp.StorageNode = other })
		}, agentOwnNodePolicy},
		{"the storage agent removing the node plugin's entry", func() error {
			return statusPatch(agent, map[string]any{"attachments": nil})
		}, agentOwnNodePolicy},
	} {
		err := tc.do()
		if tc.refused == "" {
			if err != nil {
				t.Errorf("%s (%s), with its pod's token: %v", tc.what, pv, err)
			}
			continue
		}
		if msg := refusedBy(tc.refused, err); msg != "" {
			t.Errorf("%s (%s), with its pod's token: %s", tc.what, pv, msg)
		} else {
			t.Logf("%s: refused: %v", tc.what, err)
		}
	}

	entries := func(v *v1alpha1.NBDVolume) []string {
		var nodes []string
		for _, a := range v.Status.Attachments {
			nodes = append(nodes, a.NodeID)
		}
		return nodes
	}
	after := volume()
	if after.Spec.StorageNode != node || len(after.Spec.Publications) != len(before.Spec.Publications) ||
		after.Status.Phase != before.Status.Phase || after.Status.Export == nil ||
		!slices.Equal(after.Status.Export.Addresses, before.Status.Export.Addresses) || !slices.Equal(entries(after), entries(before)) {
		t.Errorf("NBDVolume %s after the refused writes: spec %+v, status %+v, export %+v; before: spec %+v, status %+v, export %+v",
			pv, after.Spec, after.Status, after.Status.Export, before.Spec, before.Status, before.Status.Export)
		// The spec back as it was, so that the volume can still be
		// deleted; the storage agent rewrites its status.
		if err := update(admin, func(sp *v1alpha1.NBDVolumeSpec) { *sp = before.Spec }); err != nil {
			t.Errorf("restoring the spec of NBDVolume %s: %v", pv, err)
		}
	}
}
