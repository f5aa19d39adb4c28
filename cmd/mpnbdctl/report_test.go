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
	"io"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"net/url"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/client/interceptor"

	"github.com/mpnbd/mpnbd/api/v1alpha1"
	"github.com/mpnbd/mpnbd/pkg/attach"
	"github.com/mpnbd/mpnbd/pkg/driver"
)

// fleet is a cluster with a volume in every state mpnbdctl tells apart:
// node-a serves metrics (one volume degraded, 2 of 4 subflows; one
// healthy), node-b too (one volume disconnected), node-c's endpoint is
// down, and node-d has no metrics URL and no node plugin pod.
type fleet struct {
	api  client.Reader
	urls map[string]string
}

func newFleet(t *testing.T, extra ...client.Object) *fleet {
	t.Helper()
	failed := newVolume("pvc-failed", v1alpha1.VolumeFailed)
	failed.Status.Code, failed.Status.Message = "ResourceExhausted", "storage-1 has 1Gi left"
	failed.Status.Conditions = []metav1.Condition{{Type: "Ready", Status: metav1.ConditionFalse, Reason: "ResourceExhausted",
		Message: "storage-1 has 1Gi left", LastTransitionTime: metav1.NewTime(testTime)}}
	objs := append([]client.Object{
		newVolume("pvc-degraded", v1alpha1.VolumeAvailable, "node-a"),
		newVolume("pvc-healthy", v1alpha1.VolumeAvailable, "node-a"),
		newVolume("pvc-unpublished", v1alpha1.VolumeAvailable),
		newVolume("pvc-inaccessible", v1alpha1.VolumeAvailable, "node-b"),
		newVolume("pvc-notattached", v1alpha1.VolumeAvailable, "node-b"),
		newVolume("pvc-nodedown", v1alpha1.VolumeAvailable, "node-c"),
		newVolume("pvc-nometrics", v1alpha1.VolumeAvailable, "node-d"),
		failed,
		newPV("pvc-degraded", "default/data-degraded"),
		newPVC("default/data-degraded", "pvc-degraded"),
		newPV("pvc-healthy", "apps/data-healthy"),
	}, extra...)
	return &fleet{
		api: fakeAPI(t, objs...).Build(),
		urls: map[string]string{
			"node-a": nodePlugin(t, "node-a", map[string]fakeVolume{
				"pvc-degraded": {attach.Relay, 4, attach.Health{Connected: true, MPTCP: true, Subflows: []int{2}, Reconnects: 1, Paths: []attach.PathStats{
					{Connection: 0, Local: netip.MustParseAddrPort("10.0.1.2:40001"), Remote: netip.MustParseAddrPort("10.0.1.1:10809"), SentBytes: 2048, ReceivedBytes: 512},
					{Connection: 0, Local: netip.MustParseAddrPort("10.0.0.2:40000"), Remote: netip.MustParseAddrPort("10.0.0.1:10809"), SentBytes: 3 << 30, ReceivedBytes: 1 << 20,
						RetransBytes: 4 << 20, RTT: 2500 * time.Microsecond, DeliveryRate: 110 << 20},
				}}},
				"pvc-healthy": {attach.Ublk, 4, attach.Health{Connected: true, MPTCP: true, Subflows: []int{4}, Reconnects: 2, Replayed: 7, Resent: 5, Retained: 3}},
				// Attached here but published nowhere: a warning.
				"pvc-stray": {attach.Relay, 4, attach.Health{Connected: true, MPTCP: true, Subflows: []int{4}}},
			}),
			"node-b": nodePlugin(t, "node-b", map[string]fakeVolume{
				"pvc-inaccessible": {attach.FUSE, 4, attach.Health{Connected: false, MPTCP: true, Outage: 90 * time.Second, Reconnects: 4}},
			}),
			"node-c": downURL(t),
		},
	}
}

// options are the options of `mpnbdctl args...` with the fleet's
// metrics URLs.
func (f *fleet) options(t *testing.T, args ...string) *options {
	t.Helper()
	for _, n := range []string{"node-a", "node-b", "node-c"} {
		args = append(args, "--metrics-url", n+"="+f.urls[n])
	}
	o, err := parseArgs(args)
	if err != nil {
		t.Fatal(err)
	}
	return o
}

func (f *fleet) show(t *testing.T, o *options) string {
	t.Helper()
	var out bytes.Buffer
	if err := show(context.Background(), o, f.api, metricsClients{direct: &http.Client{}}, &out); err != nil {
		t.Fatal(err)
	}
	return out.String()
}

func decodeReport(t *testing.T, s string) *Report {
	t.Helper()
	var rep Report
	dec := json.NewDecoder(strings.NewReader(s))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&rep); err != nil {
		t.Fatalf("output is not a report: %v\n%s", err, s)
	}
	return &rep
}

func (r *Report) volume(t *testing.T, name string) VolumeReport {
	t.Helper()
	for _, v := range r.Volumes {
		if v.Name == name {
			return v
		}
	}
	t.Fatalf("no volume %s in the report", name)
	return VolumeReport{}
}

func intp(n int) *int { return &n }

func TestVolumesJSON(t *testing.T) {
	f := newFleet(t)
	out := f.show(t, f.options(t, "--output", "json"))
	rep := decodeReport(t, out)

	var names []string
	for _, v := range rep.Volumes {
		names = append(names, v.Name)
	}
	if want := []string{"pvc-degraded", "pvc-failed", "pvc-healthy", "pvc-inaccessible", "pvc-nodedown", "pvc-nometrics", "pvc-notattached", "pvc-unpublished"}; !slices.Equal(names, want) {
		t.Fatalf("volumes %v, want %v", names, want)
	}

	type pubWant struct {
		node, metrics, health string
		dp                    *DataPath // nil: none
	}
	tests := []struct {
		name, pv, pvc, phase, health string
		pubs                         []pubWant
		faultSource, faultNode       string
		faultHas                     string // "": no fault
	}{{
		name: "pvc-degraded", pv: "pvc-degraded", pvc: "default/data-degraded", phase: "Available", health: HealthDegraded,
		pubs: []pubWant{{"node-a", MetricsOK, HealthDegraded, &DataPath{Transport: "relay", Connected: true, MPTCP: true,
			Connections: []Connection{{Index: 0, Subflows: 2, Paths: []Path{
				{Local: "10.0.0.2", Remote: "10.0.0.1", SentBytes: 3 << 30, ReceivedBytes: 1 << 20, RetransBytes: 4 << 20, RTTSeconds: 0.0025, DeliveryRate: 110 << 20},
				{Local: "10.0.1.2", Remote: "10.0.1.1", SentBytes: 2048, ReceivedBytes: 512},
			}}}, ExpectedSubflows: intp(4), Reconnects: 1, Degraded: true}}},
		faultSource: FaultDataPath, faultNode: "node-a", faultHas: "relay: connection 0 has 2 MPTCP subflows, want 4",
	}, {
		name: "pvc-healthy", pv: "pvc-healthy", pvc: "apps/data-healthy", phase: "Available", health: HealthHealthy,
		pubs: []pubWant{{"node-a", MetricsOK, HealthHealthy, &DataPath{Transport: "ublk", Connected: true, MPTCP: true,
			Connections: []Connection{{Index: 0, Subflows: 4, Paths: []Path{}}}, ExpectedSubflows: intp(4), Reconnects: 2, ReplayedRequests: 7, ResentWrites: 5, RetainedWrites: 3}}},
		faultSource: FaultReconnects, faultNode: "node-a", faultHas: "2 reconnects since attach",
	}, {
		name: "pvc-unpublished", phase: "Available", health: HealthUnpublished,
	}, {
		name: "pvc-inaccessible", phase: "Available", health: HealthInaccessible,
		pubs: []pubWant{{"node-b", MetricsOK, HealthInaccessible, &DataPath{Transport: "fuse", MPTCP: true,
			Connections: []Connection{}, ExpectedSubflows: intp(4), Reconnects: 4, OutageSeconds: 90, Inaccessible: true}}},
		faultSource: FaultDataPath, faultNode: "node-b", faultHas: "fuse: disconnected from the storage node for 1m30s",
	}, {
		name: "pvc-notattached", phase: "Available", health: HealthNotAttached,
		pubs: []pubWant{{"node-b", MetricsNotAttached, HealthNotAttached, nil}},
	}, {
		name: "pvc-nodedown", phase: "Available", health: HealthUnknown,
		pubs: []pubWant{{"node-c", MetricsUnreachable, HealthUnknown, nil}},
	}, {
		name: "pvc-nometrics", phase: "Available", health: HealthUnknown,
		pubs: []pubWant{{"node-d", MetricsNoPod, HealthUnknown, nil}},
	}, {
		name: "pvc-failed", phase: "Failed", health: HealthFailed,
		faultSource: FaultCondition, faultHas: "Ready=False ResourceExhausted: storage-1 has 1Gi left",
	}}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			v := rep.volume(t, tc.name)
			if v.PV != tc.pv || v.PVC != tc.pvc || v.Phase != tc.phase || v.Health != tc.health {
				t.Errorf("pv %q pvc %q phase %q health %q, want %q %q %q %q", v.PV, v.PVC, v.Phase, v.Health, tc.pv, tc.pvc, tc.phase, tc.health)
			}
			if v.StorageNode != "storage-1" || v.SizeBytes != 10<<30 || v.CapacityBytes != 10<<30 || v.AccessType != "Block" ||
				v.RequestedTransport != "auto" || v.StoragePort != 10809 || len(v.StorageAddresses) != 4 {
				t.Errorf("API part %+v", v)
			}
			if len(v.Publications) != len(tc.pubs) {
				t.Fatalf("publications %+v, want %d", v.Publications, len(tc.pubs))
			}
			for i, w := range tc.pubs {
				p := v.Publications[i]
				if p.Node != w.node || p.Metrics != w.metrics || p.Health != w.health {
					t.Errorf("publication %d: node %s metrics %s health %s, want %s %s %s", i, p.Node, p.Metrics, p.Health, w.node, w.metrics, w.health)
				}
				switch {
				case w.dp == nil && p.DataPath != nil:
					t.Errorf("publication %d: data path %+v, want none", i, p.DataPath)
				case w.dp != nil && p.DataPath == nil:
					t.Errorf("publication %d: no data path", i)
				case w.dp != nil:
					got, _ := json.Marshal(p.DataPath)
					want, _ := json.Marshal(w.dp)
					if !bytes.Equal(got, want) {
						t.Errorf("publication %d: data path\n%s, want\n%s", i, got, want)
					}
				}
			}
			f := v.LastFault
			switch {
			case tc.faultHas == "" && f != nil:
				t.Errorf("last fault %+v, want none", f)
			case tc.faultHas != "" && f == nil:
				t.Errorf("no last fault, want %q", tc.faultHas)
			case f != nil && (f.Source != tc.faultSource || f.Node != tc.faultNode || !strings.Contains(f.Message, tc.faultHas)):
				t.Errorf("last fault %+v, want source %s node %q and %q", f, tc.faultSource, tc.faultNode, tc.faultHas)
			}
		})
	}

	// The nodes' endpoints.
	byNode := map[string]NodeMetrics{}
	for _, n := range rep.Nodes {
		byNode[n.Node] = n
	}
	for node, want := range map[string]string{"node-a": MetricsOK, "node-b": MetricsOK, "node-c": MetricsUnreachable, "node-d": MetricsNoPod} {
		n := byNode[node]
		if n.Status != want || (want != MetricsOK) != (n.Error != "") {
			t.Errorf("node %s: %+v, want status %s", node, n, want)
		}
	}
	if len(rep.Warnings) != 1 || !strings.Contains(rep.Warnings[0], "node node-a has volume pvc-stray attached, but there is no NBDVolume") {
		t.Errorf("warnings %q", rep.Warnings)
	}

	// The JSON names are the contract of scripts.
	var raw struct {
		Volumes []map[string]any `json:"volumes"`
	}
	if err := json.Unmarshal([]byte(out), &raw); err != nil {
		t.Fatal(err)
	}
	pub := raw.Volumes[0]["publications"].([]any)[0].(map[string]any)
	dp := pub["dataPath"].(map[string]any)
	conn := dp["connections"].([]any)[0].(map[string]any)
	if raw.Volumes[0]["lastFault"].(map[string]any)["source"] != "dataPath" || dp["expectedSubflows"] != 4.0 ||
		conn["subflows"] != 2.0 || conn["index"] != 0.0 || dp["transport"] != "relay" || raw.Volumes[0]["storageNode"] != "storage-1" {
		t.Errorf("JSON of pvc-degraded: %v", raw.Volumes[0])
	}
	path := conn["paths"].([]any)[0].(map[string]any)
	if path["local"] != "10.0.0.2" || path["remote"] != "10.0.0.1" || path["sentBytes"] != float64(3<<30) || path["receivedBytes"] != float64(1<<20) ||
		path["retransBytes"] != float64(4<<20) || path["rttSeconds"] != 0.0025 || path["deliveryRateBytes"] != float64(110<<20) {
		t.Errorf("JSON of pvc-degraded's first path: %v", path)
	}
}

func TestVolumesTable(t *testing.T) {
	f := newFleet(t)
	out := f.show(t, f.options(t))
	lines := strings.Split(out, "\n")
	header := lines[0]
	if got := strings.Fields(header); !slices.Equal(got, listColumns) {
		t.Fatalf("header %q, want %v", header, listColumns)
	}
	// Every row starts each column where the header does.
	rows := map[string]string{}
	for _, l := range lines[1:] {
		if l == "" {
			break
		}
		for _, col := range []string{"PVC", "STORAGE-NODE", "NODE", "METRICS", "HEALTH", "LAST-FAULT"} {
			i := strings.Index(header, " "+col+" ") + 1
			if col == "LAST-FAULT" {
				i = strings.Index(header, col)
			}
			if len(l) <= i || l[i-1] != ' ' || l[i] == ' ' {
				t.Errorf("column %s not aligned in %q", col, l)
			}
		}
		rows[strings.Fields(l)[0]] = l
	}
	for vol, want := range map[string][]string{
		"pvc-degraded":     {"default/data-degraded", "storage-1", "10Gi", "Available", "node-a", "ok", "relay", "yes", "2/4", "Degraded", "relay: connection 0 has 2 MPTCP subflows, want 4"},
		"pvc-healthy":      {"apps/data-healthy", "node-a", "ok", "ublk", "4/4", "Healthy", "ublk: 2 reconnects since attach"},
		"pvc-inaccessible": {"node-b", "fuse", " no ", "1m30s", "Inaccessible", "disconnected from the storage node for 1m30s"},
		"pvc-notattached":  {"node-b", "not-attached", "NotAttached"},
		"pvc-nodedown":     {"node-c", "unreachable", "Unknown"},
		"pvc-nometrics":    {"node-d", "no-pod", "Unknown"},
		"pvc-unpublished":  {"Unpublished"},
		"pvc-failed":       {"Failed", "Ready=False ResourceExhausted: storage-1 has 1Gi left"},
	} {
		r, ok := rows[vol]
		if !ok {
			t.Errorf("no row of %s in\n%s", vol, out)
			continue
		}
		for _, s := range want {
			if !strings.Contains(r, s) {
				t.Errorf("row of %s lacks %q: %q", vol, s, r)
			}
		}
	}
	for _, s := range []string{
		"Node node-d: metrics no-pod: no node plugin pod on the node (labels app.kubernetes.io/component=node,app.kubernetes.io/name=mpnbd)",
		"The node plugins' metrics are read through the API server's pod proxy",
		"Node node-c: metrics unreachable: ",
		"Warning: node node-a has volume pvc-stray attached",
	} {
		if !strings.Contains(out, s) {
			t.Errorf("output lacks %q:\n%s", s, out)
		}
	}
}

func TestVolumeDetail(t *testing.T) {
	// pvc-healthy's claim has a Warning Event of the node plugin, newer
	// than the reconnects can tell.
	at := testTime.Add(time.Hour)
	// A replicated volume: one replica in sync, the other being rebuilt.
	replicated := newVolume("pvc-replicated", v1alpha1.VolumeAvailable)
	replicated.Spec.Replicas, replicated.Spec.ReplicaNodes = 3, []string{"storage-2", "storage-3"}
	replicated.Status.Replication = &v1alpha1.ReplicationStatus{Epoch: 4, Primary: "storage-1", PrimaryEpoch: 1,
		InSync: []string{"storage-1", "storage-2"}, InSyncReplicas: 2}
	replicated.Status.Replicas = []v1alpha1.ReplicaState{{Node: "storage-2", State: "InSync"},
		{Node: "storage-3", State: "Rebuilding", LackingBytes: 64 << 20, RebuildCopiedBytes: 16 << 20, RebuildTotalBytes: 64 << 20}}
	f := newFleet(t, replicated,
		newClaimEvent("apps/data-healthy", "node-a", driver.EventStorageUnreachable, "the storage node is unreachable (transport ublk); I/O waits until it is back", at),
		newClaimEvent("apps/data-healthy", "node-a", driver.EventWritesResent, "older", at.Add(-time.Minute)),
		newPVC("apps/data-healthy", "pvc-healthy"),
	)
	tests := []struct {
		args []string
		has  []string
	}{
		{[]string{"volume", "pvc-degraded"}, []string{
			"Volume:               pvc-degraded\n",
			"Claim:                default/data-degraded\n",
			"Storage node:         storage-1 (10.0.0.1, 10.0.1.1, 10.0.2.1, 10.0.3.1; port 10809)\n",
			"Health:               Degraded\n",
			"Last fault:           node-a: relay: connection 0 has 2 MPTCP subflows, want 4 (one per storage address) (dataPath, now)\n",
			"  Ready  True    Available  2025-03-04T05:06:07Z  exported\n",
			"  node-a  ok       relay      yes        yes    2/4       1           -       0         0       0         Degraded\n",
			"  NODE    CONNECTION  SUBFLOWS  EXPECTED\n  node-a  0           2         4\n",
			"\nPaths (bytes since each subflow opened; round-trip time and delivery rate as the kernel last measured them):\n" +
				"  NODE    CONNECTION  LOCAL     REMOTE    SENT  RECEIVED  RETRANSMITTED  RTT    RATE\n" +
				"  node-a  0           10.0.0.2  10.0.0.1  3Gi   1Mi       4Mi            2.5ms  110Mi/s\n" +
				"  node-a  0           10.0.1.2  10.0.1.1  2Ki   512       0              -      -\n",
		}},
		// By claim; the last fault is the Event.
		{[]string{"volume", "apps/data-healthy"}, []string{
			"Volume:               pvc-healthy\n",
			"Last fault:           node-a: StorageUnreachable: the storage node is unreachable (transport ublk); I/O waits until it is back (event, 2025-03-04T06:06:07Z)\n",
			"  node-a  ok       ublk       yes        yes    4/4       2           -       7         5       3         Healthy\n",
			noPathsNote,
		}},
		{[]string{"volume", "pvc-unpublished"}, []string{"Health:               Unpublished\n", "Published to:\n  no node\n", "Last fault:           none seen\n"}},
		{[]string{"volume", "pvc-replicated"}, []string{
			"\nReplicas (primary storage-1, epoch 4, 2 in sync):\n" +
				"  NODE       STATE       LACKING  REBUILD\n" +
				"  storage-2  InSync      -        -\n" +
				"  storage-3  Rebuilding  64Mi     16Mi of 64Mi\n",
		}},
		{[]string{"volume", "pvc-nodedown"}, []string{"  node-c  unreachable  -", "Node node-c: metrics unreachable:"}},
	}
	for _, tc := range tests {
		t.Run(strings.Join(tc.args, " "), func(t *testing.T) {
			out := f.show(t, f.options(t, tc.args...))
			for _, s := range tc.has {
				if !strings.Contains(out, s) {
					t.Errorf("output lacks %q:\n%s", s, out)
				}
			}
			if strings.Contains(out, "pvc-stray") {
				t.Errorf("one volume's view warns of others' attachments:\n%s", out)
			}
		})
	}

	// JSON of one volume: the same report with one volume.
	rep := decodeReport(t, f.show(t, f.options(t, "volume", "apps/data-healthy", "-o", "json")))
	v := rep.volume(t, "pvc-healthy")
	if len(rep.Volumes) != 1 || len(rep.Nodes) != 1 || v.LastFault == nil || v.LastFault.Source != FaultEvent ||
		v.LastFault.Node != "node-a" || v.LastFault.Time == nil || !v.LastFault.Time.Equal(at) {
		t.Errorf("report %+v, last fault %+v", rep, v.LastFault)
	}
}

func TestMetricsFromNodeAddresses(t *testing.T) {
	node := nodePlugin(t, "node-a", map[string]fakeVolume{
		"pvc-1": {attach.Relay, 2, attach.Health{Connected: true, MPTCP: true, Subflows: []int{2}}},
	})
	u, err := url.Parse(node)
	if err != nil {
		t.Fatal(err)
	}
	hang := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { <-r.Context().Done() }))
	t.Cleanup(hang.Close)
	api := fakeAPI(t,
		newVolume("pvc-1", v1alpha1.VolumeAvailable, "node-a", "node-b", "node-c", "node-d"),
		newNode("node-a", "127.0.0.1"), newNode("node-b", ""), newNode("node-d", "127.0.0.2"),
	).Build()
	o, err := parseArgs([]string{"-o", "json", "--metrics-port", u.Port(), "--timeout", "300ms", "--metrics-url", "node-d=" + hang.URL})
	if err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	start := time.Now()
	if err := show(context.Background(), o, api, metricsClients{direct: &http.Client{}}, &out); err != nil {
		t.Fatal(err)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Errorf("took %v; a hanging node should cost --timeout", d)
	}
	rep := decodeReport(t, out.String())
	want := map[string]struct{ status, url, err string }{
		"node-a": {MetricsOK, "http://127.0.0.1:" + u.Port() + "/metrics", ""},
		"node-b": {MetricsNoAddress, "", "no Node with an InternalIP"},
		"node-c": {MetricsNoAddress, "", "no Node with an InternalIP"},
		"node-d": {MetricsUnreachable, hang.URL + "/metrics", "deadline exceeded"},
	}
	if len(rep.Nodes) != len(want) {
		t.Fatalf("nodes %+v", rep.Nodes)
	}
	for _, n := range rep.Nodes {
		w := want[n.Node]
		if n.Status != w.status || n.URL != w.url || !strings.Contains(n.Error, w.err) {
			t.Errorf("node %+v, want %+v", n, w)
		}
	}
	if v := rep.volume(t, "pvc-1"); v.Health != HealthUnknown || v.Publications[0].Health != HealthHealthy {
		t.Errorf("volume %+v", v)
	}
}

// TestMetricsThroughProxy: without --metrics-*, each node's metrics are
// read from its node plugin pod through the API server's pod proxy (an
// imitation here, behind a path prefix; TestMetricsThroughAPIServer has
// the real one); a node without a running pod, or whose pod declares no
// metrics port, says so, and the proxy's refusals are told apart.
func TestMetricsThroughProxy(t *testing.T) {
	node := nodePlugin(t, "node-a", map[string]fakeVolume{
		"pvc-1": {attach.Relay, 2, attach.Health{Connected: true, MPTCP: true, Subflows: []int{2}}},
	})
	const prefix = "/k8s/clusters/c1/api/v1/namespaces/" + nodePluginNamespace + "/pods/"
	status := func(w http.ResponseWriter, code int, reason, msg string) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(code)
		_ = json.NewEncoder(w).Encode(metav1.Status{TypeMeta: metav1.TypeMeta{Kind: "Status", APIVersion: "v1"},
			Status: metav1.StatusFailure, Message: msg, Reason: metav1.StatusReason(reason), Code: int32(code)})
	}
	var mu sync.Mutex
	var asked []string
	proxy := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		asked = append(asked, r.URL.Path)
		mu.Unlock()
		switch r.URL.Path {
		case prefix + "plugin-a:9811/proxy/metrics":
			resp, err := http.Get(node)
			if err != nil {
				status(w, http.StatusServiceUnavailable, "ServiceUnavailable", err.Error())
				return
			}
			defer resp.Body.Close()
			w.Header().Set("Content-Type", resp.Header.Get("Content-Type"))
			_, _ = io.Copy(w, resp.Body)
		case prefix + "plugin-e:9811/proxy/metrics":
			status(w, http.StatusServiceUnavailable, "ServiceUnavailable",
				"error trying to reach service: dial tcp 10.1.0.5:9811: connect: connection refused")
		case prefix + "plugin-f:9811/proxy/metrics":
			status(w, http.StatusForbidden, "Forbidden",
				`pods "plugin-f" is forbidden: User "operator" cannot get resource "pods/proxy" in API group "" in the namespace "mpnbd-system"`)
		default:
			http.NotFound(w, r)
		}
	}))
	t.Cleanup(proxy.Close)
	base, err := url.Parse(proxy.URL + "/k8s/clusters/c1")
	if err != nil {
		t.Fatal(err)
	}
	// Pods of other components, or in another namespace than -n, are not
	// node plugins to read.
	agent := newNodePluginPod("agent-b", "node-b", 9811, corev1.PodRunning, "10.1.0.2")
	agent.Labels["app.kubernetes.io/component"] = "storage-agent"
	elsewhere := newNodePluginPod("plugin-g", "node-g", 9811, corev1.PodRunning, "10.1.0.7")
	elsewhere.Namespace = "other"
	api := fakeAPI(t,
		newVolume("pvc-1", v1alpha1.VolumeAvailable, "node-a", "node-b", "node-c", "node-d", "node-e", "node-f", "node-g"),
		newNodePluginPod("plugin-a", "node-a", 9811, corev1.PodRunning, "10.1.0.1"),
		agent,
		newNodePluginPod("plugin-c", "node-c", 0, corev1.PodRunning, "10.1.0.3"),
		newNodePluginPod("plugin-d", "node-d", 9811, corev1.PodPending, ""),
		newNodePluginPod("plugin-e", "node-e", 9811, corev1.PodRunning, "10.1.0.5"),
		newNodePluginPod("plugin-f", "node-f", 9811, corev1.PodRunning, "10.1.0.6"),
		elsewhere,
	).Build()
	mc := metricsClients{direct: &http.Client{}, proxy: &apiProxy{base: base, hc: proxy.Client()}}
	for _, output := range []string{"json", "table"} {
		o, err := parseArgs([]string{"-o", output, "-n", nodePluginNamespace})
		if err != nil {
			t.Fatal(err)
		}
		var out bytes.Buffer
		if err := show(context.Background(), o, api, mc, &out); err != nil {
			t.Fatal(err)
		}
		if output == "table" {
			for _, s := range []string{
				"node-c  no-port ",
				"Node node-c: metrics no-port: node plugin pod mpnbd-system/plugin-c declares no container port named metrics",
				"The node plugins' metrics are read through the API server's pod proxy (list on pods, get on pods/proxy)",
			} {
				if !strings.Contains(out.String(), s) {
					t.Errorf("table lacks %q:\n%s", s, out.String())
				}
			}
			continue
		}
		rep := decodeReport(t, out.String())
		want := map[string]struct{ status, pod, url, err string }{
			"node-a": {MetricsOK, "mpnbd-system/plugin-a", proxy.URL + prefix + "plugin-a:9811/proxy/metrics", ""},
			"node-b": {MetricsNoPod, "", "", "no node plugin pod on the node"},
			"node-c": {MetricsNoPort, "mpnbd-system/plugin-c", "", "declares no container port named metrics"},
			"node-d": {MetricsNoPod, "mpnbd-system/plugin-d", "", "plugin-d is Pending, not Running"},
			"node-e": {MetricsUnreachable, "mpnbd-system/plugin-e", proxy.URL + prefix + "plugin-e:9811/proxy/metrics",
				"503 Service Unavailable: error trying to reach service: dial tcp 10.1.0.5:9811: connect: connection refused"},
			"node-f": {MetricsError, "mpnbd-system/plugin-f", proxy.URL + prefix + "plugin-f:9811/proxy/metrics",
				`cannot get resource "pods/proxy"`},
			"node-g": {MetricsNoPod, "", "", "no node plugin pod on the node"},
		}
		if len(rep.Nodes) != len(want) {
			t.Fatalf("nodes %+v", rep.Nodes)
		}
		for _, n := range rep.Nodes {
			w := want[n.Node]
			if n.Status != w.status || n.Pod != w.pod || n.URL != w.url || !strings.Contains(n.Error, w.err) || (w.err == "") != (n.Error == "") {
				t.Errorf("node %+v, want %+v", n, w)
			}
		}
		if n := rep.Nodes[5]; !strings.Contains(n.Error, "needs get on pods/proxy") {
			t.Errorf("node-f's refusal does not name the permission: %q", n.Error)
		}
		if p := rep.Volumes[0].Publications[0]; p.Metrics != MetricsOK || p.Health != HealthHealthy || p.DataPath == nil || subflowsText(p.DataPath) != "2/2" {
			t.Errorf("node-a's publication %+v", p)
		}
	}
	mu.Lock()
	defer mu.Unlock()
	if len(asked) != 6 {
		t.Errorf("the proxy was asked %q; want node-a, node-e and node-f once per output", asked)
	}
}

func TestAPIFailures(t *testing.T) {
	forbidden := func(gr string) error {
		return apierrors.NewForbidden(schema.GroupResource{Resource: gr}, "", nil)
	}
	tests := []struct {
		name    string
		args    []string
		list    func(client.ObjectList) error // nil: pass through
		wantErr string                        // "": succeeds
		warning string
	}{
		{"no such volume", []string{"volume", "pvc-x"}, nil, `NBDVolume "pvc-x" not found`, ""},
		{"claim not bound", []string{"volume", "default/unbound"}, nil, "claim default/unbound is not bound", ""},
		{"no claim", []string{"volume", "default/nope"}, nil, "claim default/nope", ""},
		{"volumes forbidden", nil, func(l client.ObjectList) error {
			if _, ok := l.(*v1alpha1.NBDVolumeList); ok {
				return forbidden("nbdvolumes")
			}
			return nil
		}, "listing NBDVolumes: nbdvolumes is forbidden", ""},
		{"PVs forbidden", nil, func(l client.ObjectList) error {
			if _, ok := l.(*corev1.PersistentVolumeList); ok {
				return forbidden("persistentvolumes")
			}
			return nil
		}, "", "PersistentVolumes not read"},
		{"Nodes forbidden", []string{"--metrics-port", "9811"}, func(l client.ObjectList) error {
			if _, ok := l.(*corev1.NodeList); ok {
				return forbidden("nodes")
			}
			return nil
		}, "", "Nodes not read"},
		{"Pods forbidden", nil, func(l client.ObjectList) error {
			if _, ok := l.(*corev1.PodList); ok {
				return forbidden("pods")
			}
			return nil
		}, "", "Pods not read, so the node plugins' metrics cannot be read through the API server (list on pods is needed)"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			b := fakeAPI(t, newVolume("pvc-1", v1alpha1.VolumeAvailable, "node-a"), newPV("pvc-1", "default/data"),
				newPVC("default/unbound", ""))
			if tc.list != nil {
				b = b.WithInterceptorFuncs(interceptor.Funcs{List: func(ctx context.Context, c client.WithWatch, l client.ObjectList, opts ...client.ListOption) error {
					if err := tc.list(l); err != nil {
						return err
					}
					return c.List(ctx, l, opts...)
				}})
			}
			o, err := parseArgs(append([]string{"-o", "json"}, tc.args...))
			if err != nil {
				t.Fatal(err)
			}
			var out bytes.Buffer
			err = show(context.Background(), o, b.Build(), metricsClients{direct: &http.Client{}}, &out)
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("error %v, want %q", err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			rep := decodeReport(t, out.String())
			if len(rep.Warnings) != 1 || !strings.Contains(rep.Warnings[0], tc.warning) || len(rep.Volumes) != 1 {
				t.Errorf("warnings %q, want %q", rep.Warnings, tc.warning)
			}
		})
	}
}

// TestLastFaultConditionPolarity: the controller's conditions of a
// healthy volume (Reachable and ReplicasInSync True, Degraded False) are
// no fault; Degraded True, DeletionBlocked True and Reachable False are,
// named with their status.
func TestLastFaultConditionPolarity(t *testing.T) {
	at := metav1.NewTime(testTime)
	vol := newVolume("pvc-c", v1alpha1.VolumeAvailable)
	vol.Status.Conditions = []metav1.Condition{
		{Type: v1alpha1.ConditionReachable, Status: metav1.ConditionTrue, Reason: v1alpha1.ReasonStorageNodeReady, LastTransitionTime: at},
		{Type: v1alpha1.ConditionReplicasInSync, Status: metav1.ConditionTrue, Reason: v1alpha1.ReasonAllInSync, LastTransitionTime: at},
		{Type: v1alpha1.ConditionDegraded, Status: metav1.ConditionFalse, Reason: v1alpha1.ReasonPathsUp, LastTransitionTime: at},
	}
	if f := lastFault(vol, nil, nil); f != nil {
		t.Errorf("a healthy volume's conditions: fault %+v", f)
	}
	for i, c := range []struct {
		typ    string
		status metav1.ConditionStatus
		want   string
	}{
		{v1alpha1.ConditionDegraded, metav1.ConditionTrue, "Degraded=True PathsDown"},
		{"DeletionBlocked", metav1.ConditionTrue, "DeletionBlocked=True PathsDown"},
		{v1alpha1.ConditionReachable, metav1.ConditionFalse, "Reachable=False PathsDown"},
	} {
		v := vol.DeepCopy()
		v.Status.Conditions = append(v.Status.Conditions[:0:0], metav1.Condition{Type: c.typ, Status: c.status, Reason: v1alpha1.ReasonPathsDown,
			Message: "m", LastTransitionTime: metav1.NewTime(testTime.Add(time.Duration(i+1) * time.Minute))})
		f := lastFault(v, nil, nil)
		if f == nil || f.Source != FaultCondition || !strings.HasPrefix(f.Message, c.want) {
			t.Errorf("%s=%s: fault %+v, want one saying %q", c.typ, c.status, f, c.want)
		}
	}
}

// TestVolumesFilters: --storage-node keeps the volumes with data on it
// (primary, only copy or replica), --node those published to it,
// --unhealthy those not Healthy; they combine, and the metrics read are
// those of the nodes the kept volumes are published to. A volume filtered
// out but attached on a node read is not taken for a stray.
func TestVolumesFilters(t *testing.T) {
	replicated := newVolume("pvc-replicated", v1alpha1.VolumeAvailable, "node-a")
	replicated.Spec.StorageNode, replicated.Spec.ReplicaNodes, replicated.Spec.Replicas = "storage-2", []string{"storage-3"}, 2
	f := newFleet(t, replicated)
	stray := "node node-a has volume pvc-stray attached, but there is no NBDVolume pvc-stray"
	tests := []struct {
		args         []string
		volumes      []string
		nodes        []string
		strayWarning bool
	}{
		{[]string{"--node", "node-a"}, []string{"pvc-degraded", "pvc-healthy", "pvc-replicated"}, []string{"node-a"}, true},
		{[]string{"--storage-node", "storage-2"}, []string{"pvc-replicated"}, []string{"node-a"}, true},
		{[]string{"--storage-node", "storage-3"}, []string{"pvc-replicated"}, []string{"node-a"}, true},
		{[]string{"--storage-node", "storage-1"}, []string{"pvc-degraded", "pvc-failed", "pvc-healthy", "pvc-inaccessible", "pvc-nodedown",
			"pvc-nometrics", "pvc-notattached", "pvc-unpublished"}, []string{"node-a", "node-b", "node-c", "node-d"}, true},
		{[]string{"--unhealthy"}, []string{"pvc-degraded", "pvc-failed", "pvc-inaccessible", "pvc-nodedown", "pvc-nometrics",
			"pvc-notattached", "pvc-replicated", "pvc-unpublished"}, []string{"node-a", "node-b", "node-c", "node-d"}, true},
		{[]string{"--node", "node-a", "--unhealthy"}, []string{"pvc-degraded", "pvc-replicated"}, []string{"node-a"}, true},
		{[]string{"--node", "node-b", "--storage-node", "storage-2"}, nil, nil, false},
		{[]string{"--node", "node-z"}, nil, nil, false},
	}
	for _, tc := range tests {
		t.Run(strings.Join(tc.args, " "), func(t *testing.T) {
			rep := decodeReport(t, f.show(t, f.options(t, append([]string{"-o", "json"}, tc.args...)...)))
			var vols, nodes []string
			for _, v := range rep.Volumes {
				vols = append(vols, v.Name)
			}
			for _, n := range rep.Nodes {
				nodes = append(nodes, n.Node)
			}
			if !slices.Equal(vols, tc.volumes) || !slices.Equal(nodes, tc.nodes) {
				t.Errorf("volumes %v on nodes %v, want %v on %v", vols, nodes, tc.volumes, tc.nodes)
			}
			if want := []string{stray}; (tc.strayWarning && !slices.Equal(rep.Warnings, want)) || (!tc.strayWarning && len(rep.Warnings) > 0) {
				t.Errorf("warnings %q", rep.Warnings)
			}
		})
	}
	out := f.show(t, f.options(t, "--node", "node-z"))
	if out != "No NBDVolume matches the filters.\n" {
		t.Errorf("nothing kept: %q", out)
	}
	out = f.show(t, f.options(t, "--unhealthy"))
	if strings.Contains(out, "pvc-healthy") || !strings.Contains(out, "pvc-degraded") {
		t.Errorf("--unhealthy table:\n%s", out)
	}
}

// TestStorageNodes: one row per NBDStorageNode with its Ready condition,
// maintenance, capacity, what it holds and its orphans; volumes on a
// storage node without an NBDStorageNode are a warning.
func TestStorageNodes(t *testing.T) {
	node := func(name string, ready metav1.ConditionStatus, reason, msg string, orphans ...string) *v1alpha1.NBDStorageNode {
		sn := &v1alpha1.NBDStorageNode{ObjectMeta: metav1.ObjectMeta{Name: name}, Status: v1alpha1.NBDStorageNodeStatus{
			CapacityBytes: 100 << 30, AvailableBytes: 60 << 30, Heartbeat: metav1.NewTime(testTime.Add(time.Hour)), Orphans: orphans,
		}}
		if ready != "" {
			sn.Status.Conditions = []metav1.Condition{{Type: v1alpha1.ConditionReady, Status: ready, Reason: reason, Message: msg,
				LastTransitionTime: metav1.NewTime(testTime)}}
		}
		return sn
	}
	volume := func(name, primary string, replicas ...string) *v1alpha1.NBDVolume {
		v := newVolume(name, v1alpha1.VolumeAvailable)
		v.Spec.StorageNode, v.Spec.ReplicaNodes = primary, replicas
		if len(replicas) > 0 {
			v.Spec.Replicas = int32(len(replicas) + 1)
		}
		return v
	}
	s2 := node("s2", metav1.ConditionFalse, v1alpha1.ReasonAgentNotReporting, "the agent's lease has not been renewed for 6s")
	s2.Spec = v1alpha1.NBDStorageNodeSpec{Unschedulable: true, Drain: true}
	api := fakeAPI(t,
		node("s1", metav1.ConditionTrue, v1alpha1.ReasonAgentReporting, "reporting", "pvc-old", "pvc-older"),
		s2,
		node("s3", "", "", ""),
		volume("v-unreplicated", "s1"),
		volume("v-rep1", "s1", "s2", "s3"),
		volume("v-rep2", "s2", "s1"),
		volume("v-lost", "s9"),
		volume("v-lostreplica", "s3", "s9"),
	).Build()
	o, err := parseArgs([]string{"storage-nodes", "-o", "json"})
	if err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	if err := runCommand(context.Background(), o, &apiConn{client: api}, &out); err != nil {
		t.Fatal(err)
	}
	var rep StorageNodesReport
	dec := json.NewDecoder(strings.NewReader(out.String()))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&rep); err != nil {
		t.Fatalf("not a storage nodes report: %v\n%s", err, out.String())
	}
	since, beat := testTime, testTime.Add(time.Hour)
	want := []StorageNodeReport{
		{Name: "s1", Ready: "True", Reason: v1alpha1.ReasonAgentReporting, Message: "reporting", Since: &since, Heartbeat: &beat,
			CapacityBytes: 100 << 30, AvailableBytes: 60 << 30, Primaries: 1, Unreplicated: 1, Replicas: 1, Orphans: 2, OrphanFiles: []string{"pvc-old", "pvc-older"}},
		{Name: "s2", Ready: "False", Reason: v1alpha1.ReasonAgentNotReporting, Message: "the agent's lease has not been renewed for 6s", Since: &since, Heartbeat: &beat,
			Cordoned: true, Draining: true, CapacityBytes: 100 << 30, AvailableBytes: 60 << 30, Primaries: 1, Replicas: 1},
		{Name: "s3", Ready: "Unknown", Heartbeat: &beat, CapacityBytes: 100 << 30, AvailableBytes: 60 << 30, Primaries: 1, Replicas: 1},
	}
	got, _ := json.Marshal(rep.StorageNodes)
	w, _ := json.Marshal(want)
	if !bytes.Equal(got, w) {
		t.Errorf("storage nodes\n%s\nwant\n%s", got, w)
	}
	if len(rep.Warnings) != 1 || rep.Warnings[0] != "storage node s9 has no NBDStorageNode (lost for good, or its agent has not reported yet) but holds 2 volume(s): v-lost (unreplicated), v-lostreplica (replica)" {
		t.Errorf("warnings %q", rep.Warnings)
	}
	// The JSON names are the contract of scripts.
	if !strings.Contains(out.String(), `"storageNodes": [`) || !strings.Contains(out.String(), `"availableBytes": 64424509440`) ||
		!strings.Contains(out.String(), `"unreplicated": 1`) {
		t.Errorf("JSON:\n%s", out.String())
	}

	o.output = outputTable
	out.Reset()
	if err := storageNodes(context.Background(), o, api, &out); err != nil {
		t.Fatal(err)
	}
	for _, s := range []string{
		"NAME  READY    REASON             CORDONED  DRAINING  CAPACITY  AVAILABLE  PRIMARIES  UNREPLICATED  REPLICAS  ORPHANS\n",
		"s1    True     AgentReporting     no        no        100Gi     60Gi       1          1             1         2\n",
		"s2    False    AgentNotReporting  yes       yes       100Gi     60Gi       1          0             1         0\n",
		"s3    Unknown  -                  no        no        100Gi     60Gi       1          0             1         0\n",
		"Storage node s2: Ready False (AgentNotReporting) since 2025-03-04T05:06:07Z: the agent's lease has not been renewed for 6s\n",
		"Storage node s3: Ready Unknown\n",
		"Storage node s1: 2 orphan file(s), backing files with no NBDVolume, never deleted by the driver: pvc-old, pvc-older\n",
		"Warning: storage node s9 has no NBDStorageNode",
	} {
		if !strings.Contains(out.String(), s) {
			t.Errorf("table lacks %q:\n%s", s, out.String())
		}
	}

	// None at all.
	out.Reset()
	if err := storageNodes(context.Background(), o, fakeAPI(t).Build(), &out); err != nil || out.String() != "No NBDStorageNodes: no storage agent has reported.\n" {
		t.Errorf("no storage node: %v %q", err, out.String())
	}
}
