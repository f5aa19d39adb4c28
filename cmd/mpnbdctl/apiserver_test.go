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

package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/netip"
	"net/url"
	"os"
	"regexp"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/util/retry"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/mpnbd/mpnbd/api/v1alpha1"
	"github.com/mpnbd/mpnbd/internal/testenv/apiserver"
	"github.com/mpnbd/mpnbd/pkg/access"
	"github.com/mpnbd/mpnbd/pkg/attach"
	"github.com/mpnbd/mpnbd/pkg/buildinfo"
	"github.com/mpnbd/mpnbd/pkg/driver"
)

// TestRunAgainstAPIServer runs the command end to end against a real API
// server with the CRDs of deploy/crds: a volume published to two nodes,
// one found by --metrics-url, the other by its Node's InternalIP and
// --metrics-port, and its claim's Event found by field selector.
func TestRunAgainstAPIServer(t *testing.T) {
	cfg, c := apiserver.Start(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()

	nodeA := nodePlugin(t, "node-a", map[string]fakeVolume{
		"pvc-1": {attach.Relay, 4, attach.Health{Connected: true, MPTCP: true, Subflows: []int{2}, Reconnects: 1}},
	})
	nodeB := nodePlugin(t, "node-b", map[string]fakeVolume{
		"pvc-1": {attach.Relay, 4, attach.Health{Connected: true, MPTCP: true, Subflows: []int{4}}},
	})
	b, err := url.Parse(nodeB)
	if err != nil {
		t.Fatal(err)
	}

	create := func(o client.Object) {
		t.Helper()
		status := o.DeepCopyObject().(client.Object)
		if err := c.Create(ctx, o); err != nil {
			t.Fatalf("creating %T %s: %v", o, o.GetName(), err)
		}
		// Status is a subresource of these: write it as the agent and
		// the kubelet do.
		switch s := status.(type) {
		case *v1alpha1.NBDVolume:
			s.ResourceVersion = o.GetResourceVersion()
			if err := c.Status().Update(ctx, s); err != nil {
				t.Fatalf("status of %s: %v", s.Name, err)
			}
		case *corev1.Node:
			s.ResourceVersion = o.GetResourceVersion()
			if err := c.Status().Update(ctx, s); err != nil {
				t.Fatalf("status of %s: %v", s.Name, err)
			}
		}
	}
	vol := newVolume("pvc-1", v1alpha1.VolumeAvailable, "node-a", "node-b")
	vol.Finalizers = []string{v1alpha1.Finalizer}
	create(vol)
	create(newVolume("pvc-2", v1alpha1.VolumeAvailable))
	create(newPV("pvc-1", "default/data"))
	create(newPVC("default/data", "pvc-1"))
	create(newNode("node-a", "192.0.2.1")) // found by --metrics-url instead
	create(newNode("node-b", "127.0.0.1"))
	at := time.Now().Truncate(time.Second)
	create(newClaimEvent("default/data", "node-a", driver.EventStorageUnreachable, "the storage node is unreachable (transport relay)", at))
	// Another claim's Event, to be left out.
	create(newClaimEvent("default/other", "node-a", driver.EventWritesResent, "other claim", at.Add(time.Minute)))

	kc := apiserver.WriteKubeconfig(t, cfg)
	mpnbdctl := func(args ...string) string {
		t.Helper()
		var out, errb bytes.Buffer
		args = append([]string{"--kubeconfig", kc, "--metrics-url", "node-a=" + nodeA, "--metrics-port", b.Port()}, args...)
		if code := run(ctx, args, &out, &errb); code != 0 {
			t.Fatalf("mpnbdctl %q: exit %d: %s", args, code, errb.String())
		}
		return out.String()
	}

	rep := decodeReport(t, mpnbdctl("-o", "json"))
	if len(rep.Volumes) != 2 || len(rep.Warnings) != 0 || len(rep.Nodes) != 2 {
		t.Fatalf("report %+v", rep)
	}
	v := rep.volume(t, "pvc-1")
	if v.PV != "pvc-1" || v.PVC != "default/data" || v.Phase != "Available" || v.StorageNode != "storage-1" ||
		v.SizeBytes != 10<<30 || v.Health != HealthDegraded || len(v.Conditions) != 1 {
		t.Errorf("pvc-1: %+v", v)
	}
	if len(v.Publications) != 2 {
		t.Fatalf("publications %+v", v.Publications)
	}
	for i, want := range []struct {
		node, health, subflows string
	}{{"node-a", HealthDegraded, "2/4"}, {"node-b", HealthHealthy, "4/4"}} {
		p := v.Publications[i]
		if p.Node != want.node || p.Metrics != MetricsOK || p.Health != want.health || p.DataPath == nil ||
			p.DataPath.Transport != "relay" || subflowsText(p.DataPath) != want.subflows {
			t.Errorf("publication %d: %+v %+v", i, p, p.DataPath)
		}
	}
	if n := rep.Nodes[1]; n.Node != "node-b" || n.URL != "http://127.0.0.1:"+b.Port()+"/metrics" || n.Status != MetricsOK {
		t.Errorf("node-b found at %+v", n)
	}
	if f := v.LastFault; f == nil || f.Source != FaultDataPath || f.Node != "node-a" {
		t.Errorf("last fault %+v", f)
	}
	if v := rep.volume(t, "pvc-2"); v.Health != HealthUnpublished || v.PV != "" || len(v.Publications) != 0 {
		t.Errorf("pvc-2: %+v", v)
	}

	// The filters.
	for _, tc := range []struct {
		args []string
		want []string
	}{
		{[]string{"--node", "node-b"}, []string{"pvc-1"}},
		{[]string{"--storage-node", "storage-1"}, []string{"pvc-1", "pvc-2"}},
		{[]string{"--storage-node", "storage-2"}, nil},
		// pvc-1 is Degraded on node-a, pvc-2 Unpublished.
		{[]string{"--unhealthy"}, []string{"pvc-1", "pvc-2"}},
		{[]string{"--unhealthy", "--node", "node-a"}, []string{"pvc-1"}},
	} {
		var names []string
		for _, v := range decodeReport(t, mpnbdctl(append([]string{"-o", "json"}, tc.args...)...)).Volumes {
			names = append(names, v.Name)
		}
		if !slices.Equal(names, tc.want) {
			t.Errorf("volumes %q: %v, want %v", tc.args, names, tc.want)
		}
	}

	table := mpnbdctl()
	for _, s := range []string{strings.Join(listColumns, "  "), "pvc-1   default/data  storage-1     10Gi  Available  node-a  ok", "2/4", "4/4", "Unpublished"} {
		if !strings.Contains(strings.Join(strings.Fields(table), " "), strings.Join(strings.Fields(s), " ")) {
			t.Errorf("table lacks %q:\n%s", s, table)
		}
	}

	// Healthy on both nodes now: the claim's Event is the last fault.
	nodeA = nodePlugin(t, "node-a", map[string]fakeVolume{
		"pvc-1": {attach.Relay, 4, attach.Health{Connected: true, MPTCP: true, Subflows: []int{4}, Reconnects: 1}},
	})
	detail := mpnbdctl("volume", "default/data")
	for _, s := range []string{
		"Volume:               pvc-1\n",
		"Health:               Healthy\n",
		"Last fault:           node-a: StorageUnreachable: the storage node is unreachable (transport relay) (event, " + at.UTC().Format(time.RFC3339) + ")\n",
		noPathsNote,
	} {
		if !strings.Contains(detail, s) {
			t.Errorf("detail lacks %q:\n%s", s, detail)
		}
	}

	// A volume that is not there.
	var out, errb bytes.Buffer
	if code := run(ctx, []string{"--kubeconfig", kc, "volume", "pvc-x"}, &out, &errb); code != 1 || errb.String() != "mpnbdctl: NBDVolume \"pvc-x\" not found\n" {
		t.Errorf("volume pvc-x: exit %d, stderr %q", code, errb.String())
	}
}

// TestUninstallCheckAgainstAPIServer: uninstall-check fails while a
// volume exists, naming it and its claim, and passes once none is left.
func TestUninstallCheckAgainstAPIServer(t *testing.T) {
	cfg, c := apiserver.Start(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	kc := apiserver.WriteKubeconfig(t, cfg)
	check := func() (int, string) {
		var out, errb bytes.Buffer
		code := run(ctx, []string{"--kubeconfig", kc, "uninstall-check"}, &out, &errb)
		return code, out.String() + errb.String()
	}
	if code, out := check(); code != 0 || !strings.Contains(out, "no volumes") {
		t.Fatalf("with no volume: exit %d:\n%s", code, out)
	}
	for _, o := range []client.Object{newVolume("pvc-9", v1alpha1.VolumeAvailable, "node-a"), newPV("pvc-9", "apps/db")} {
		if err := c.Create(ctx, o); err != nil {
			t.Fatal(err)
		}
	}
	code, out := check()
	if code != 1 || !strings.Contains(out, "1 volume(s) still exist") || !strings.Contains(out, "pvc-9\tapps/db\t") ||
		!strings.Contains(out, "published to node-a") {
		t.Errorf("with a volume: exit %d, want 1 and the volume with its claim:\n%s", code, out)
	}
	// A snapshot outliving its volume keeps a file on its storage node:
	// the check still refuses, naming it and its VolumeSnapshot.
	snap := &v1alpha1.NBDSnapshot{
		ObjectMeta: metav1.ObjectMeta{Name: "snap-1", Annotations: map[string]string{access.AnnotationVolumeSnapshot: "apps/nightly"}},
		Spec:       v1alpha1.NBDSnapshotSpec{SourceVolume: "pvc-9", StorageNode: "node-a"},
	}
	if err := c.Create(ctx, snap); err != nil {
		t.Fatal(err)
	}
	if err := c.Delete(ctx, &v1alpha1.NBDVolume{ObjectMeta: metav1.ObjectMeta{Name: "pvc-9"}}); err != nil {
		t.Fatal(err)
	}
	code, out = check()
	if code != 1 || !strings.Contains(out, "1 snapshot(s) still exist") || !strings.Contains(out, "snap-1\tapps/nightly\tof volume pvc-9\tstorage node node-a") {
		t.Errorf("with a snapshot left: exit %d, want 1 and the snapshot:\n%s", code, out)
	}
	if err := c.Delete(ctx, snap); err != nil {
		t.Fatal(err)
	}
	if code, out := check(); code != 0 {
		t.Errorf("after the volume and the snapshot went: exit %d:\n%s", code, out)
	}
}

// TestMaintenanceAgainstAPIServer: cordon, uncordon and drain set the
// storage node's fields; drain follows what the node holds until nothing
// is left, and fails naming the unreplicated volumes a drain leaves.
func TestMaintenanceAgainstAPIServer(t *testing.T) {
	cfg, c := apiserver.Start(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	kc := apiserver.WriteKubeconfig(t, cfg)
	cmd := func(args ...string) (int, string) {
		var out, errb bytes.Buffer
		code := run(ctx, append([]string{"--kubeconfig", kc}, args...), &out, &errb)
		return code, out.String() + errb.String()
	}
	for _, n := range []string{"s1", "s2"} {
		if err := c.Create(ctx, &v1alpha1.NBDStorageNode{ObjectMeta: metav1.ObjectMeta{Name: n}}); err != nil {
			t.Fatal(err)
		}
	}
	spec := func(n string) v1alpha1.NBDStorageNodeSpec {
		t.Helper()
		var sn v1alpha1.NBDStorageNode
		if err := c.Get(ctx, client.ObjectKey{Name: n}, &sn); err != nil {
			t.Fatal(err)
		}
		return sn.Spec
	}
	if code, out := cmd("cordon", "s1"); code != 0 || !strings.Contains(out, "cordoned") || spec("s1") != (v1alpha1.NBDStorageNodeSpec{Unschedulable: true}) {
		t.Fatalf("cordon: exit %d, spec %+v:\n%s", code, spec("s1"), out)
	}
	if code, out := cmd("drain", "s1", "--wait", "0"); code != 0 || spec("s1") != (v1alpha1.NBDStorageNodeSpec{Unschedulable: true, Drain: true}) {
		t.Fatalf("drain --wait 0: exit %d, spec %+v:\n%s", code, spec("s1"), out)
	}
	if code, out := cmd("storage-nodes"); code != 0 || !regexp.MustCompile(`(?m)^s1 +Unknown +- +yes +yes `).MatchString(out) ||
		!regexp.MustCompile(`(?m)^s2 +Unknown +- +no +no `).MatchString(out) {
		t.Errorf("storage-nodes after drain s1: exit %d, want s1 cordoned and draining:\n%s", code, out)
	}
	if code, out := cmd("uncordon", "s1"); code != 0 || spec("s1") != (v1alpha1.NBDStorageNodeSpec{}) {
		t.Fatalf("uncordon: exit %d, spec %+v:\n%s", code, spec("s1"), out)
	}
	if code, out := cmd("cordon", "nosuch"); code != 1 || !strings.Contains(out, "storage node nosuch") || !strings.Contains(out, "not found") {
		t.Errorf("cordon of an unknown node: exit %d:\n%s", code, out)
	}
	if code, _ := cmd("drain"); code != 2 {
		t.Errorf("drain without NODE: exit %d, want 2", code)
	}

	// s1 holds a replica of vr (in sync) and unreplicated vu.
	vr := newVolume("vr", v1alpha1.VolumeAvailable)
	vr.Spec.StorageNode, vr.Spec.ReplicaNodes, vr.Spec.Replicas = "s2", []string{"s1"}, 2
	vu := newVolume("vu", v1alpha1.VolumeAvailable)
	vu.Spec.StorageNode = "s1"
	for _, v := range []*v1alpha1.NBDVolume{vr, vu} {
		if err := c.Create(ctx, v); err != nil {
			t.Fatal(err)
		}
	}
	type result struct {
		code int
		out  string
	}
	done := make(chan result, 1)
	go func() {
		code, out := cmd("drain", "s1", "--wait", "1m")
		done <- result{code, out}
	}()
	// The controller's part: vr's replica moves to s3 (taken as in sync),
	// then vu, unreplicated, moves to s2.
	update := func(name string, change func(*v1alpha1.NBDVolume)) {
		t.Helper()
		time.Sleep(3 * time.Second)
		err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
			var v v1alpha1.NBDVolume
			if err := c.Get(ctx, client.ObjectKey{Name: name}, &v); err != nil {
				return err
			}
			change(&v)
			return c.Update(ctx, &v)
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	update("vr", func(v *v1alpha1.NBDVolume) { v.Spec.ReplicaNodes = []string{"s3"} })
	update("vu", func(v *v1alpha1.NBDVolume) { v.Spec.StorageNode = "s2" })
	var r result
	select {
	case r = <-done:
	case <-time.After(time.Minute):
		t.Fatal("drain did not return within a minute of the node holding nothing")
	}
	if r.code != 0 || !strings.Contains(r.out, "s1 holds 2 volume(s): vr (replica), vu (unreplicated)") ||
		!strings.Contains(r.out, "s1 holds 1 volume(s): vu (unreplicated)") || !strings.Contains(r.out, "storage node s1 drained: it holds no volume") {
		t.Errorf("drain: exit %d, want 0 after vr and vu moved:\n%s", r.code, r.out)
	}
	if err := c.Delete(ctx, vu); err != nil {
		t.Fatal(err)
	}
	if code, out := cmd("drain", "s1", "--wait", "1m"); code != 0 || !strings.Contains(out, "storage node s1 drained: it holds no volume") {
		t.Errorf("drain of a node that holds nothing: exit %d:\n%s", code, out)
	}
	if code, out := cmd("drain", "s2", "--wait", "2s"); code != 1 || !strings.Contains(out, "still holds") {
		t.Errorf("drain of a node whose volumes do not move: exit %d, want 1 when the wait ends:\n%s", code, out)
	}
}

// TestForgetAgainstAPIServer: forget refuses a storage node whose agent
// reports (or whose state the controller has not said), leaving it be,
// and deletes one whose agent is not reporting, saying what happens to
// each volume it held.
func TestForgetAgainstAPIServer(t *testing.T) {
	cfg, c := apiserver.Start(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	kc := apiserver.WriteKubeconfig(t, cfg)
	cmd := func(args ...string) (int, string) {
		var out, errb bytes.Buffer
		code := run(ctx, append([]string{"--kubeconfig", kc}, args...), &out, &errb)
		return code, out.String() + errb.String()
	}
	node := func(name string, ready metav1.ConditionStatus, reason string) {
		t.Helper()
		sn := &v1alpha1.NBDStorageNode{ObjectMeta: metav1.ObjectMeta{Name: name}}
		if err := c.Create(ctx, sn); err != nil {
			t.Fatal(err)
		}
		if reason == "" {
			return
		}
		sn.Status.Heartbeat = metav1.Now()
		meta.SetStatusCondition(&sn.Status.Conditions, metav1.Condition{Type: v1alpha1.ConditionReady, Status: ready, Reason: reason, Message: "set by the test"})
		if err := c.Status().Update(ctx, sn); err != nil {
			t.Fatal(err)
		}
	}
	node("alive", metav1.ConditionTrue, v1alpha1.ReasonAgentReporting)
	node("stale", metav1.ConditionFalse, v1alpha1.ReasonHeartbeatStale)
	node("new", "", "")
	node("dead", metav1.ConditionFalse, v1alpha1.ReasonAgentNotReporting)
	vu := newVolume("vu", v1alpha1.VolumeAvailable)
	vu.Spec.StorageNode = "dead"
	vr := newVolume("vr", v1alpha1.VolumeAvailable)
	vr.Spec.StorageNode, vr.Spec.ReplicaNodes, vr.Spec.Replicas = "alive", []string{"dead"}, 2
	for _, v := range []*v1alpha1.NBDVolume{vu, vr} {
		if err := c.Create(ctx, v); err != nil {
			t.Fatal(err)
		}
	}
	exists := func(name string) bool {
		t.Helper()
		err := c.Get(ctx, client.ObjectKey{Name: name}, &v1alpha1.NBDStorageNode{})
		if err != nil && !apierrors.IsNotFound(err) {
			t.Fatal(err)
		}
		return err == nil
	}
	for _, n := range []string{"alive", "stale", "new"} {
		if code, out := cmd("forget", n); code != 1 || !strings.Contains(out, "its storage agent reports") || !exists(n) {
			t.Errorf("forget %s: exit %d, exists %v, want 1 and kept:\n%s", n, code, exists(n), out)
		}
	}
	// What each holds, and how the controller sees it.
	code, out := cmd("storage-nodes", "-o", "json")
	var rep StorageNodesReport
	if err := json.Unmarshal([]byte(out), &rep); code != 0 || err != nil || len(rep.StorageNodes) != 4 || len(rep.Warnings) != 0 {
		t.Fatalf("storage-nodes: exit %d, %v:\n%s", code, err, out)
	}
	for i, want := range []struct {
		name, ready, reason              string
		primaries, unreplicated, replica int
	}{
		{"alive", "True", v1alpha1.ReasonAgentReporting, 1, 0, 0},
		{"dead", "False", v1alpha1.ReasonAgentNotReporting, 0, 1, 1},
		{"new", "Unknown", "", 0, 0, 0},
		{"stale", "False", v1alpha1.ReasonHeartbeatStale, 0, 0, 0},
	} {
		n := rep.StorageNodes[i]
		if n.Name != want.name || n.Ready != want.ready || n.Reason != want.reason || n.Primaries != want.primaries ||
			n.Unreplicated != want.unreplicated || n.Replicas != want.replica || (want.reason != "") != (n.Since != nil) {
			t.Errorf("storage node %d: %+v, want %+v", i, n, want)
		}
	}

	code, out = cmd("forget", "dead")
	if code != 0 || exists("dead") {
		t.Fatalf("forget dead: exit %d, exists %v:\n%s", code, exists("dead"), out)
	}
	for _, want := range []string{"storage node dead forgotten", "vr (replica): its replica is replaced", "vu (unreplicated): its only copy is lost"} {
		if !strings.Contains(out, want) {
			t.Errorf("forget dead does not say %q:\n%s", want, out)
		}
	}
	if code, out := cmd("forget", "dead"); code != 1 || !strings.Contains(out, "not found") {
		t.Errorf("forget of a forgotten node: exit %d:\n%s", code, out)
	}
	// Until the controller has moved them, its volumes still name it.
	if code, out := cmd("storage-nodes"); code != 0 || strings.Contains(out, "\ndead ") ||
		!strings.Contains(out, "Warning: storage node dead has no NBDStorageNode (lost for good, or its agent has not reported yet) but holds 2 volume(s): vr (replica), vu (unreplicated)") {
		t.Errorf("storage-nodes after forget dead: exit %d:\n%s", code, out)
	}
}

// TestMetricsThroughAPIServer: with no --metrics-* flag, mpnbdctl reads a
// node's metrics from its node plugin pod through the real API server's
// pod proxy (the fake node plugin listens on an address of this host that
// the API server proxies to: it refuses loopback). A node without a node
// plugin pod, one whose pod declares no metrics port and one whose pod
// does not answer say so. An operator with the permissions the usage
// names reads the metrics; one without get on pods/proxy is told it
// lacks it.
func TestMetricsThroughAPIServer(t *testing.T) {
	addr := hostAddress(t)
	if addr == "" {
		msg := "this host has no IPv4 address the API server proxies to (up, not loopback, not link-local)"
		fmt.Fprintf(os.Stderr, "%s: skipping: %s\n", t.Name(), msg)
		t.Skip(msg)
	}
	cfg, c := apiserver.Start(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()

	plugin := nodePluginAt(t, addr, "node-p", map[string]fakeVolume{
		"pvc-1": {attach.Relay, 2, attach.Health{Connected: true, MPTCP: true, Subflows: []int{2}, Paths: []attach.PathStats{
			{Connection: 0, Local: netip.MustParseAddrPort("10.0.0.2:40000"), Remote: netip.MustParseAddrPort("10.0.0.1:10809"), SentBytes: 4096, ReceivedBytes: 1024},
		}}},
	})
	u, err := url.Parse(plugin)
	if err != nil {
		t.Fatal(err)
	}
	port, err := strconv.Atoi(u.Port())
	if err != nil {
		t.Fatal(err)
	}
	// A port of addr where nothing listens.
	l, err := net.Listen("tcp", net.JoinHostPort(addr, "0"))
	if err != nil {
		t.Fatal(err)
	}
	gone := l.Addr().(*net.TCPAddr).Port
	l.Close()

	for _, o := range []client.Object{
		&corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: nodePluginNamespace}},
		&corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Namespace: nodePluginNamespace, Name: "default"}},
		newVolume("pvc-1", v1alpha1.VolumeAvailable, "node-p", "node-q", "node-r", "node-s"),
	} {
		if err := c.Create(ctx, o); err != nil && !apierrors.IsAlreadyExists(err) {
			t.Fatalf("creating %T %s: %v", o, o.GetName(), err)
		}
	}
	// node-q has no node plugin pod; node-r's declares no metrics port;
	// node-s's does not answer on it.
	for _, p := range []*corev1.Pod{
		newNodePluginPod("plugin-p", "node-p", int32(port), corev1.PodRunning, addr),
		newNodePluginPod("plugin-r", "node-r", 0, corev1.PodRunning, addr),
		newNodePluginPod("plugin-s", "node-s", int32(gone), corev1.PodRunning, addr),
	} {
		status := p.Status
		if err := c.Create(ctx, p); err != nil {
			t.Fatalf("creating pod %s: %v", p.Name, err)
		}
		// As the kubelet does.
		p.Status = status
		if err := c.Status().Update(ctx, p); err != nil {
			t.Fatalf("status of pod %s: %v", p.Name, err)
		}
	}

	mpnbdctl := func(cfg *rest.Config) *Report {
		t.Helper()
		var out, errb bytes.Buffer
		args := []string{"--kubeconfig", apiserver.WriteKubeconfig(t, cfg), "-o", "json", "--timeout", "10s"}
		if code := run(ctx, args, &out, &errb); code != 0 {
			t.Fatalf("mpnbdctl %q: exit %d: %s", args, code, errb.String())
		}
		return decodeReport(t, out.String())
	}
	rep := mpnbdctl(cfg)
	want := map[string]struct{ status, pod, err string }{
		"node-p": {MetricsOK, nodePluginNamespace + "/plugin-p", ""},
		"node-q": {MetricsNoPod, "", "no node plugin pod on the node"},
		"node-r": {MetricsNoPort, nodePluginNamespace + "/plugin-r", "declares no container port named metrics"},
		"node-s": {MetricsUnreachable, nodePluginNamespace + "/plugin-s", net.JoinHostPort(addr, strconv.Itoa(gone))},
	}
	if len(rep.Nodes) != len(want) || len(rep.Warnings) != 0 {
		t.Fatalf("nodes %+v, warnings %q", rep.Nodes, rep.Warnings)
	}
	for _, n := range rep.Nodes {
		w := want[n.Node]
		if n.Status != w.status || n.Pod != w.pod || !strings.Contains(n.Error, w.err) || (w.err == "") != (n.Error == "") {
			t.Errorf("node %+v, want %+v", n, w)
		}
	}
	if n := rep.Nodes[0]; !strings.HasSuffix(n.URL, fmt.Sprintf("/api/v1/namespaces/%s/pods/plugin-p:%d/proxy/metrics", nodePluginNamespace, port)) ||
		!strings.HasPrefix(n.URL, cfg.Host) {
		t.Errorf("node-p read at %q, want the API server's pod proxy", n.URL)
	}
	v := rep.volume(t, "pvc-1")
	p := v.Publications[0]
	if p.Node != "node-p" || p.Metrics != MetricsOK || p.Health != HealthHealthy || p.DataPath == nil || p.DataPath.Transport != "relay" ||
		subflowsText(p.DataPath) != "2/2" || len(p.DataPath.Connections[0].Paths) != 1 || p.DataPath.Connections[0].Paths[0].SentBytes != 4096 {
		t.Errorf("node-p's publication %+v, data path %+v", p, p.DataPath)
	}
	for i, want := range []string{MetricsNoPod, MetricsNoPort, MetricsUnreachable} {
		if p := v.Publications[i+1]; p.Metrics != want || p.Health != HealthUnknown || p.DataPath != nil {
			t.Errorf("publication %d: %+v, want metrics %s", i+1, p, want)
		}
	}

	// An operator with the permissions the usage names; another without
	// get on pods/proxy.
	rules := []rbacv1.PolicyRule{
		{APIGroups: []string{v1alpha1.GroupVersion.Group}, Resources: []string{"nbdvolumes"}, Verbs: []string{"list"}},
		{APIGroups: []string{""}, Resources: []string{"persistentvolumes", "pods"}, Verbs: []string{"list"}},
		{APIGroups: []string{""}, Resources: []string{"pods/proxy"}, Verbs: []string{"get"}},
	}
	for user, rules := range map[string][]rbacv1.PolicyRule{"operator": rules, "viewer": rules[:2]} {
		for _, o := range []client.Object{
			&rbacv1.ClusterRole{ObjectMeta: metav1.ObjectMeta{Name: user}, Rules: rules},
			&rbacv1.ClusterRoleBinding{ObjectMeta: metav1.ObjectMeta{Name: user},
				RoleRef:  rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: user},
				Subjects: []rbacv1.Subject{{APIGroup: rbacv1.GroupName, Kind: rbacv1.UserKind, Name: user}}},
		} {
			if err := c.Create(ctx, o); err != nil {
				t.Fatal(err)
			}
		}
	}
	as := func(user string) *rest.Config {
		ic := rest.CopyConfig(cfg)
		ic.Impersonate = rest.ImpersonationConfig{UserName: user, Groups: []string{"system:authenticated"}}
		return ic
	}
	// RBAC takes effect within a moment.
	var n NodeMetrics
	for end := time.Now().Add(20 * time.Second); ; time.Sleep(200 * time.Millisecond) {
		rep := mpnbdctl(as("operator"))
		n = rep.Nodes[0]
		if (n.Status == MetricsOK && len(rep.Warnings) == 0) || time.Now().After(end) {
			break
		}
	}
	if n.Status != MetricsOK || n.Pod != nodePluginNamespace+"/plugin-p" {
		t.Errorf("as an operator with list on pods and get on pods/proxy: node-p %+v", n)
	}
	rep = mpnbdctl(as("viewer"))
	if n := rep.Nodes[0]; n.Status != MetricsError || !strings.Contains(n.Error, "403 Forbidden") || !strings.Contains(n.Error, "needs get on pods/proxy") {
		t.Errorf("as an operator without get on pods/proxy: node-p %+v", n)
	}
}

// TestVersionAgainstAPIServer: version lists the driver's Deployments and
// DaemonSets (by the chart's label, in every namespace or in -n) with the
// image of each one's main container, says whether they agree, and fails
// only when the API server does not answer, after printing its own
// version.
func TestVersionAgainstAPIServer(t *testing.T) {
	cfg, c := apiserver.Start(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	kc := apiserver.WriteKubeconfig(t, cfg)
	cmd := func(kc string, args ...string) (int, string, string) {
		var out, errb bytes.Buffer
		code := run(ctx, append([]string{"--kubeconfig", kc, "version"}, args...), &out, &errb)
		return code, out.String(), errb.String()
	}
	decode := func(s string) *VersionReport {
		t.Helper()
		var rep VersionReport
		dec := json.NewDecoder(strings.NewReader(s))
		dec.DisallowUnknownFields()
		if err := dec.Decode(&rep); err != nil {
			t.Fatalf("not a version report: %v\n%s", err, s)
		}
		return &rep
	}

	const image = "registry.example/mpnbd/mpnbd:0.3.0"
	template := func(component string, containers ...corev1.Container) corev1.PodTemplateSpec {
		return corev1.PodTemplateSpec{
			ObjectMeta: metav1.ObjectMeta{Labels: map[string]string{"app.kubernetes.io/name": "mpnbd", componentLabel: component}},
			Spec:       corev1.PodSpec{Containers: containers},
		}
	}
	workloadMeta := func(ns, name, component string) metav1.ObjectMeta {
		return metav1.ObjectMeta{Namespace: ns, Name: name, Labels: map[string]string{
			"app.kubernetes.io/name": "mpnbd", "app.kubernetes.io/instance": "mpnbd", componentLabel: component,
		}}
	}
	selector := func(component string) *metav1.LabelSelector {
		return &metav1.LabelSelector{MatchLabels: map[string]string{"app.kubernetes.io/name": "mpnbd", componentLabel: component}}
	}
	// The chart's workloads: sidecars first in the controller, to show the
	// main container is found by name.
	controller := &appsv1.Deployment{ObjectMeta: workloadMeta(nodePluginNamespace, "mpnbd-controller", "controller"),
		Spec: appsv1.DeploymentSpec{Selector: selector("controller"), Template: template("controller",
			corev1.Container{Name: "csi-provisioner", Image: "registry.k8s.io/sig-storage/csi-provisioner:v6.0.0"},
			corev1.Container{Name: "controller", Image: image})}}
	node := &appsv1.DaemonSet{ObjectMeta: workloadMeta(nodePluginNamespace, "mpnbd-node", "node"),
		Spec: appsv1.DaemonSetSpec{Selector: selector("node"), Template: template("node",
			corev1.Container{Name: "node", Image: image},
			corev1.Container{Name: "node-driver-registrar", Image: "registry.k8s.io/sig-storage/csi-node-driver-registrar:v2.13.0"})}}
	// The storage agents in a namespace of their own.
	agent := &appsv1.DaemonSet{ObjectMeta: workloadMeta("storage", "mpnbd-storage-agent", "storage-agent"),
		Spec: appsv1.DaemonSetSpec{Selector: selector("storage-agent"), Template: template("storage-agent",
			corev1.Container{Name: "storage-agent", Image: image})}}
	// Not the driver's.
	other := &appsv1.Deployment{ObjectMeta: metav1.ObjectMeta{Namespace: nodePluginNamespace, Name: "web", Labels: map[string]string{"app.kubernetes.io/name": "web"}},
		Spec: appsv1.DeploymentSpec{Selector: &metav1.LabelSelector{MatchLabels: map[string]string{"app": "web"}},
			Template: corev1.PodTemplateSpec{ObjectMeta: metav1.ObjectMeta{Labels: map[string]string{"app": "web"}},
				Spec: corev1.PodSpec{Containers: []corev1.Container{{Name: "web", Image: "nginx"}}}}}}
	for _, o := range []client.Object{
		&corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: nodePluginNamespace}},
		&corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "storage"}},
		controller, node, agent, other,
	} {
		if err := c.Create(ctx, o); err != nil {
			t.Fatalf("creating %T %s: %v", o, o.GetName(), err)
		}
	}

	code, out, errs := cmd(kc, "-o", "json")
	if code != 0 {
		t.Fatalf("version -o json: exit %d: %s", code, errs)
	}
	rep := decode(out)
	want := []ComponentVersion{
		{"controller", "Deployment", nodePluginNamespace, "mpnbd-controller", "controller", image},
		{"node", "DaemonSet", nodePluginNamespace, "mpnbd-node", "node", image},
		{"storage-agent", "DaemonSet", "storage", "mpnbd-storage-agent", "storage-agent", image},
	}
	if !slices.Equal(rep.Components, want) || !rep.Agree || !slices.Equal(rep.Images, []string{image}) || len(rep.Warnings) != 0 ||
		rep.Client.Version != buildinfo.Version || rep.Client.GoVersion != runtime.Version() || rep.Client.Revision == "" {
		t.Errorf("report %+v, want components %+v agreeing on %s", rep, want, image)
	}
	code, out, _ = cmd(kc)
	for _, s := range []string{
		"mpnbdctl " + buildinfo.Version + " (revision ",
		"COMPONENT      KIND        NAMESPACE     NAME                 CONTAINER      IMAGE\n",
		"controller     Deployment  mpnbd-system  mpnbd-controller     controller     " + image + "\n",
		"The components agree: they run " + image + ".\n",
	} {
		if code != 0 || !strings.Contains(out, s) {
			t.Errorf("version: exit %d, output lacks %q:\n%s", code, s, out)
		}
	}

	// An upgrade half done: the node plugins run another image.
	const newer = "registry.example/mpnbd/mpnbd:0.4.0"
	err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		var ds appsv1.DaemonSet
		if err := c.Get(ctx, client.ObjectKeyFromObject(node), &ds); err != nil {
			return err
		}
		ds.Spec.Template.Spec.Containers[0].Image = newer
		return c.Update(ctx, &ds)
	})
	if err != nil {
		t.Fatal(err)
	}
	code, out, _ = cmd(kc, "-o", "json")
	if rep := decode(out); code != 0 || rep.Agree || !slices.Equal(rep.Images, []string{image, newer}) || rep.Components[1].Image != newer {
		t.Errorf("after the node plugins' image changed: exit %d, %+v", code, rep)
	}
	code, out, _ = cmd(kc)
	if s := "The components do not agree (an upgrade under way, or a workload changed by hand): " + image +
		" (mpnbd-controller, mpnbd-storage-agent); " + newer + " (mpnbd-node).\n"; code != 0 || !strings.Contains(out, s) {
		t.Errorf("version: exit %d, output lacks %q:\n%s", code, s, out)
	}
	// One namespace.
	code, out, _ = cmd(kc, "-o", "json", "-n", "storage")
	if rep := decode(out); code != 0 || len(rep.Components) != 1 || rep.Components[0].Name != "mpnbd-storage-agent" || !rep.Agree {
		t.Errorf("version -n storage: exit %d, %+v", code, rep)
	}
	code, out, _ = cmd(kc, "-n", "nothing-here")
	if code != 0 || !strings.Contains(out, "No Deployment or DaemonSet labelled app.kubernetes.io/name=mpnbd in namespace nothing-here") {
		t.Errorf("version -n nothing-here: exit %d:\n%s", code, out)
	}

	// A user who may list nothing: the API server answers, so version
	// succeeds with warnings.
	nobody := rest.CopyConfig(cfg)
	nobody.Impersonate = rest.ImpersonationConfig{UserName: "nobody", Groups: []string{"system:authenticated"}}
	code, out, errs = cmd(apiserver.WriteKubeconfig(t, nobody), "-o", "json")
	if rep := decode(out); code != 0 || len(rep.Components) != 0 || rep.Agree || len(rep.Warnings) != 2 ||
		!strings.Contains(rep.Warnings[0], "Deployments not read") || !strings.Contains(rep.Warnings[1], "forbidden") {
		t.Errorf("version as a user who may list nothing: exit %d, %+v, stderr %q", code, rep, errs)
	}

	// No API server there: its own version, then exit 1.
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	down := rest.CopyConfig(cfg)
	down.Host = "https://" + l.Addr().String()
	l.Close()
	code, out, errs = cmd(apiserver.WriteKubeconfig(t, down), "--timeout", "2s")
	if code != 1 || !strings.HasPrefix(out, "mpnbdctl "+buildinfo.Version+" (revision ") || !strings.Contains(errs, "listing Deployments") {
		t.Errorf("version without an API server: exit %d, stdout %q, stderr %q", code, out, errs)
	}
}
