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
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
)

// argsOf returns the args of a workload's container.
func argsOf(t *testing.T, objs []*unstructured.Unstructured, kind, name, ctr string) []string {
	t.Helper()
	for _, c := range containers(t, []*unstructured.Unstructured{find(t, objs, kind, name)}) {
		if c.name == ctr {
			return c.args
		}
	}
	t.Fatalf("%s %s has no container %s", kind, name, ctr)
	return nil
}

// TestChartValues: non-default values reach the objects they configure.
func TestChartValues(t *testing.T) {
	objs := parseObjects(t, customTemplate(t))
	for _, o := range objs {
		if ns := o.GetNamespace(); ns != "" && ns != customNamespace {
			t.Errorf("%s: namespace %q, want the release's, %s", objectKey(o), ns, customNamespace)
		}
		if o.GetKind() == "Namespace" {
			t.Errorf("the chart renders the Namespace %s: the release's namespace is Helm's or the user's to make", o.GetName())
		}
	}

	has := func(what string, args []string, want ...string) {
		t.Helper()
		for _, w := range want {
			if !slices.Contains(args, w) {
				t.Errorf("%s args %q lack %q", what, args, w)
			}
		}
	}
	has("node", argsOf(t, objs, "DaemonSet", "mpnbd-node", "node"),
		"--storage-nic=eth1,eth2,10.10.3.0/24", "--backup-nic=eth0", "--auto-backup=false", "--storage-address=$(STORAGE_ADDRESS)",
		"--storage-address=10.10.1.5,10.10.3.0/24", "--max-volumes=32", "--datapath-socket=/var/lib/mpnbd/state/datapath.sock",
		"--state-dir=/var/lib/mpnbd/state", "--log-level=debug", "--log-format=json", "--metrics-addr=:19810")
	has("datapath", argsOf(t, objs, "DaemonSet", "mpnbd-datapath", "datapath"),
		"--serve-datapath=/var/lib/mpnbd/state/datapath.sock", "--transports=relay,multiconn,fuse",
		"--state-dir=/var/lib/mpnbd/state", "--log-level=debug", "--log-format=json")
	dp := find(t, objs, "DaemonSet", "mpnbd-datapath")
	if st, _, _ := unstructured.NestedString(dp.Object, "spec", "updateStrategy", "type"); st != "OnDelete" {
		t.Errorf("datapath.updateStrategy.type=OnDelete rendered %q", st)
	}
	has("registrar", argsOf(t, objs, "DaemonSet", "mpnbd-node", "node-driver-registrar"),
		"--kubelet-registration-path=/var/lib/k0s/kubelet/plugins/nbd.mptcp.mpnbd.io/csi.sock", "--v=5")
	has("storage agent", argsOf(t, objs, "DaemonSet", "mpnbd-storage-agent", "storage-agent"),
		"--cluster", "--data-dir=/srv/mpnbd", "--listen=:10900", "--metrics-addr=:19810", "--signal-nic=eth1,eth2",
		"--auto-backup=false", "--storage-address=10.10.1.1,10.10.2.1,10.10.3.0/24", "--shutdown-timeout=60s", "--reserved-handshakes=100",
		"--max-handshakes=1024")
	has("controller", argsOf(t, objs, "Deployment", "mpnbd-controller", "controller"),
		"--wait-timeout=90s", "--stale-after=5m", "--log-format=json")
	has("provisioner", argsOf(t, objs, "Deployment", "mpnbd-controller", "csi-provisioner"),
		"--timeout=300s", "--default-fstype=xfs", "--enable-capacity", "--capacity-ownerref-level=2", "--kube-api-qps=50", "--kube-api-burst=100")

	agent := find(t, objs, "DaemonSet", "mpnbd-storage-agent")
	if sel, _, _ := unstructured.NestedStringMap(agent.Object, "spec", "template", "spec", "nodeSelector"); sel["storage.example.com/pool"] != "fast" || len(sel) != 1 {
		t.Errorf("storage agent nodeSelector %v", sel)
	}
	if hn, _, _ := unstructured.NestedBool(agent.Object, "spec", "template", "spec", "hostNetwork"); hn {
		t.Error("storageAgent.hostNetwork=false not rendered")
	}
	ctl := find(t, objs, "Deployment", "mpnbd-controller")
	// apiServer reaches every container that talks to the API server.
	for _, o := range []*unstructured.Unstructured{ctl, agent, find(t, objs, "DaemonSet", "mpnbd-node")} {
		cs, _, _ := unstructured.NestedSlice(o.Object, "spec", "template", "spec", "containers")
		for _, c := range cs {
			cm := c.(map[string]any)
			name := cm["name"].(string)
			if name == "liveness-probe" || name == "node-driver-registrar" { // CSI socket only
				continue
			}
			env, _, _ := unstructured.NestedSlice(cm, "env")
			got := map[string]any{}
			for _, e := range env {
				em := e.(map[string]any)
				got[em["name"].(string)] = em["value"]
			}
			if got["KUBERNETES_SERVICE_HOST"] != "10.1.2.3" || got["KUBERNETES_SERVICE_PORT"] != "6443" {
				t.Errorf("%s/%s: API server env %v", o.GetName(), name, got)
			}
		}
	}
	if hn, _, _ := unstructured.NestedBool(ctl.Object, "spec", "template", "spec", "hostNetwork"); !hn {
		t.Error("controller.hostNetwork=true not rendered")
	}
	// On the host network a surge pod could not start beside the old one.
	if surge, _, _ := unstructured.NestedFieldNoCopy(ctl.Object, "spec", "strategy", "rollingUpdate", "maxSurge"); fmt.Sprint(surge) != "0" {
		t.Errorf("controller on the host network: maxSurge %v, want 0", surge)
	}
	for _, c := range containers(t, []*unstructured.Unstructured{ctl}) {
		if c.name == "controller" && c.image != "registry.example.com/mpnbd/mpnbd:v0.2.0" {
			t.Errorf("controller image %s", c.image)
		}
	}

	sc := find(t, objs, "StorageClass", "fast-xfs")
	params, _, _ := unstructured.NestedStringMap(sc.Object, "parameters")
	if params["transport"] != "relay" || params["fsType"] != "" || params["csi.storage.k8s.io/fstype"] != "xfs" ||
		params["storageNodeSelector"] != "storage.example.com/pool=fast" {
		t.Errorf("fast-xfs parameters %v", params)
	}
	if sc.GetAnnotations()["storageclass.kubernetes.io/is-default-class"] != "true" {
		t.Errorf("fast-xfs annotations %v", sc.GetAnnotations())
	}
	raw := find(t, objs, "StorageClass", "raw-tcp")
	if p, _, _ := unstructured.NestedStringMap(raw.Object, "parameters"); p["transport"] != "tcp" {
		t.Errorf("raw-tcp parameters %v: its own transport must win over defaultTransport", p)
	}
	if exp, ok, _ := unstructured.NestedBool(raw.Object, "allowVolumeExpansion"); !ok || exp {
		t.Errorf("raw-tcp allowVolumeExpansion %v (set: %v), want false", exp, ok)
	}
	if len(objs) == 0 || find(t, objs, "ServiceMonitor", "mpnbd-storage-agent") == nil {
		t.Error("no ServiceMonitor")
	}
	rule := find(t, objs, "PrometheusRule", "mpnbd")
	if !strings.Contains(fmt.Sprint(rule.Object["spec"]), "increase(mpnbd_node_volume_reconnects_total[10m]) > 10") ||
		!strings.Contains(fmt.Sprint(rule.Object["spec"]), "mpnbd_server_capacity_bytes) > 90") || rule.GetLabels()["release"] != "prometheus" {
		t.Errorf("PrometheusRule without the values' thresholds and labels: %v %v", rule.GetLabels(), rule.Object["spec"])
	}
	if pm := find(t, objs, "PodMonitor", "mpnbd-node"); pm.GetLabels()["release"] != "prometheus" {
		t.Errorf("PodMonitor mpnbd-node labels %v", pm.GetLabels())
	}
	if cm := find(t, objs, "ConfigMap", "mpnbd-grafana-dashboard"); cm.GetLabels()["grafana"] != "main" ||
		cm.GetAnnotations()["grafana_folder"] != "Storage" {
		t.Errorf("dashboard ConfigMap labels %v, annotations %v", cm.GetLabels(), cm.GetAnnotations())
	}

	// Defaults: no ServiceMonitor, no Service.
	for _, o := range parseObjects(t, helmTemplate(t)) {
		if o.GetKind() == "ServiceMonitor" || o.GetKind() == "Service" {
			t.Errorf("default values render %s", objectKey(o))
		}
	}
}

// TestChartRefusesAgentWithoutAddresses: a storage agent needs the
// addresses clients dial.
func TestChartRefusesAgentWithoutAddresses(t *testing.T) {
	_, err := tryTemplate(t, "--set", "storageAgent.storageAddressesFrom=")
	if err == nil || !strings.Contains(err.Error(), "storageAddressesFrom") {
		t.Errorf("helm template without storage addresses: %v", err)
	}
	// Without the agent the addresses do not matter.
	if _, err := tryTemplate(t, "--set", "storageAgent.storageAddressesFrom=", "--set", "storageAgent.enabled=false"); err != nil {
		t.Error(err)
	}
}

// TestChartWithoutDatapath: with datapath.enabled=false there is no
// datapath DaemonSet and the node plugin runs the transports itself.
func TestChartWithoutDatapath(t *testing.T) {
	objs := parseObjects(t, helmTemplate(t, "e2e/deploy/testdata/values-no-datapath.yaml"))
	for _, o := range objs {
		if o.GetName() == "mpnbd-datapath" {
			t.Errorf("datapath.enabled=false renders %s", objectKey(o))
		}
	}
	args := argsOf(t, objs, "DaemonSet", "mpnbd-node", "node")
	if !slices.Contains(args, "--transports=relay,fuse") {
		t.Errorf("node args %q lack the transports", args)
	}
	for _, a := range args {
		if strings.HasPrefix(a, "--datapath-socket") {
			t.Errorf("node args %q drive a datapath that is not deployed", args)
		}
	}
}

// TestChartSnapshots: by default the controller runs the csi-snapshotter
// with its ClusterRole, and the VolumeSnapshotClass is rendered only where
// the cluster serves the snapshot API (it could not be created without its
// CRD); snapshots.enabled=false drops all three.
func TestChartSnapshots(t *testing.T) {
	const api = "snapshot.storage.k8s.io/v1/VolumeSnapshotClass"
	has := func(objs []*unstructured.Unstructured, kind, name string) bool {
		return slices.ContainsFunc(objs, func(o *unstructured.Unstructured) bool { return o.GetKind() == kind && o.GetName() == name })
	}
	sidecar := func(objs []*unstructured.Unstructured) bool {
		for _, c := range containers(t, objs) {
			if c.workload == "Deployment/mpnbd-controller" && c.name == "csi-snapshotter" {
				return true
			}
		}
		return false
	}
	objs := parseObjects(t, helmTemplate(t))
	if !sidecar(objs) || !has(objs, "ClusterRole", "mpnbd-external-snapshotter") || !has(objs, "ClusterRoleBinding", "mpnbd-external-snapshotter") {
		t.Errorf("defaults: csi-snapshotter %v, its ClusterRole %v", sidecar(objs), has(objs, "ClusterRole", "mpnbd-external-snapshotter"))
	}
	if has(objs, "VolumeSnapshotClass", "mpnbd-snapshots") {
		t.Error("a VolumeSnapshotClass rendered for a cluster without the snapshot API")
	}
	objs = render(t, "--api-versions", api, "--set", "snapshots.volumeSnapshotClass.deletionPolicy=Retain")
	vsc := find(t, objs, "VolumeSnapshotClass", "mpnbd-snapshots")
	if d, _, _ := unstructured.NestedString(vsc.Object, "driver"); d != "nbd.mptcp.mpnbd.io" {
		t.Errorf("VolumeSnapshotClass driver %q", d)
	}
	if p, _, _ := unstructured.NestedString(vsc.Object, "deletionPolicy"); p != "Retain" {
		t.Errorf("VolumeSnapshotClass deletionPolicy %q, want Retain", p)
	}
	if vsc.GetAnnotations()["snapshot.storage.kubernetes.io/is-default-class"] != "true" {
		t.Errorf("VolumeSnapshotClass annotations %v: not the default", vsc.GetAnnotations())
	}
	objs = render(t, "--api-versions", api, "--set", "snapshots.enabled=false")
	if sidecar(objs) || has(objs, "ClusterRole", "mpnbd-external-snapshotter") || has(objs, "VolumeSnapshotClass", "mpnbd-snapshots") {
		t.Error("snapshots.enabled=false still renders the snapshotter, its role or the class")
	}
}

// TestDatapathUpgradesByHandover: by default the datapath DaemonSet
// surges (the new pod beside the old one, which it takes the volumes
// from) and its pods are ready only once they serve, so the old pod goes
// only after the handover.
func TestDatapathUpgradesByHandover(t *testing.T) {
	objs := parseObjects(t, helmTemplate(t))
	dp := find(t, objs, "DaemonSet", "mpnbd-datapath")
	surge, _, _ := unstructured.NestedFieldNoCopy(dp.Object, "spec", "updateStrategy", "rollingUpdate", "maxSurge")
	unavail, _, _ := unstructured.NestedFieldNoCopy(dp.Object, "spec", "updateStrategy", "rollingUpdate", "maxUnavailable")
	if st, _, _ := unstructured.NestedString(dp.Object, "spec", "updateStrategy", "type"); st != "RollingUpdate" || fmt.Sprint(surge) != "1" || fmt.Sprint(unavail) != "0" {
		t.Errorf("datapath update strategy %s, maxSurge %v, maxUnavailable %v; want RollingUpdate, 1, 0", st, surge, unavail)
	}
	args := argsOf(t, objs, "DaemonSet", "mpnbd-datapath", "datapath")
	if !slices.Contains(args, "--ready-file=/tmp/datapath-ready") {
		t.Errorf("datapath args %q lack the ready file", args)
	}
	ctrs, _, _ := unstructured.NestedSlice(dp.Object, "spec", "template", "spec", "containers")
	c := ctrs[0].(map[string]any)
	probe, _, _ := unstructured.NestedStringSlice(c, "readinessProbe", "exec", "command")
	if strings.Join(probe, " ") != "test -e /tmp/datapath-ready" {
		t.Errorf("datapath readiness probe %q", probe)
	}
}

// intField returns an integer field of o, which the YAML decoder may
// have made an int64 or a float64.
func intField(o *unstructured.Unstructured, fields ...string) (int64, bool) {
	v, ok, _ := unstructured.NestedFieldNoCopy(o.Object, fields...)
	switch n := v.(type) {
	case int64:
		return n, ok
	case float64:
		return int64(n), ok && n == float64(int64(n))
	}
	return 0, false
}

// podSpecField returns a field of a workload's pod spec.
func podSpecField(t *testing.T, o *unstructured.Unstructured, field string) (any, bool) {
	t.Helper()
	v, ok, err := unstructured.NestedFieldNoCopy(o.Object, "spec", "template", "spec", field)
	if err != nil {
		t.Fatal(err)
	}
	return v, ok
}

// TestChartPriorityAndDisruption: each workload's priorityClassName and
// the controller's PodDisruptionBudget come from values; by default the
// node-level DaemonSets are mpnbd-node-critical, the controller
// mpnbd-cluster-critical, PriorityClasses the chart renders itself (the
// system-* ones are refused outside kube-system where a ResourceQuota
// keeps them to it), and the budget lets a drain evict the one controller
// pod.
func TestChartPriorityAndDisruption(t *testing.T) {
	workloads := []struct{ kind, name, priority string }{
		{"Deployment", "mpnbd-controller", "mpnbd-cluster-critical"},
		{"DaemonSet", "mpnbd-node", "mpnbd-node-critical"},
		{"DaemonSet", "mpnbd-datapath", "mpnbd-node-critical"},
		{"DaemonSet", "mpnbd-storage-agent", "mpnbd-node-critical"},
	}
	objs := parseObjects(t, helmTemplate(t))
	for _, w := range workloads {
		if got, _ := podSpecField(t, find(t, objs, w.kind, w.name), "priorityClassName"); got != w.priority {
			t.Errorf("%s %s: priorityClassName %v, want %s", w.kind, w.name, got, w.priority)
		}
	}
	// The classes are rendered, the node's above the controller's (as
	// system-node-critical is above system-cluster-critical), both at most
	// 1000000000, the highest value the API server allows a class not
	// named system-*, and neither the cluster's default.
	values := map[string]int64{}
	for _, name := range []string{"mpnbd-node-critical", "mpnbd-cluster-critical"} {
		pc := find(t, objs, "PriorityClass", name)
		v, ok := intField(pc, "value")
		if g, _, _ := unstructured.NestedBool(pc.Object, "globalDefault"); !ok || v > 1000000000 || g || pc.GetAPIVersion() != "scheduling.k8s.io/v1" {
			t.Errorf("PriorityClass %s: %s, value %d (set: %v), globalDefault %v", name, pc.GetAPIVersion(), v, ok, g)
		}
		values[name] = v
	}
	if values["mpnbd-node-critical"] <= values["mpnbd-cluster-critical"] {
		t.Errorf("PriorityClass values %v: want the node's above the controller's", values)
	}
	// priorityClasses.create=false with existing classes named instead.
	objs = render(t, "--set", "priorityClasses.create=false", "--set", "node.priorityClassName=system-node-critical",
		"--set", "controller.priorityClassName=system-cluster-critical")
	for _, o := range objs {
		if o.GetKind() == "PriorityClass" {
			t.Errorf("priorityClasses.create=false renders %s", objectKey(o))
		}
	}
	if got, _ := podSpecField(t, find(t, objs, "DaemonSet", "mpnbd-node"), "priorityClassName"); got != "system-node-critical" {
		t.Errorf("node.priorityClassName=system-node-critical rendered %v", got)
	}
	if got, _ := podSpecField(t, find(t, objs, "Deployment", "mpnbd-controller"), "priorityClassName"); got != "system-cluster-critical" {
		t.Errorf("controller.priorityClassName=system-cluster-critical rendered %v", got)
	}
	objs = render(t, "--set", "priorityClasses.nodeCritical=5000", "--set", "priorityClasses.clusterCritical=4000")
	for name, want := range map[string]int64{"mpnbd-node-critical": 5000, "mpnbd-cluster-critical": 4000} {
		if v, _ := intField(find(t, objs, "PriorityClass", name), "value"); v != want {
			t.Errorf("PriorityClass %s: value %d, want %d", name, v, want)
		}
	}
	objs = parseObjects(t, helmTemplate(t))
	pdb := find(t, objs, "PodDisruptionBudget", "mpnbd-controller")
	if pdb.GetAPIVersion() != "policy/v1" || pdb.GetNamespace() != "mpnbd-system" {
		t.Errorf("PodDisruptionBudget %s in %q", pdb.GetAPIVersion(), pdb.GetNamespace())
	}
	spec, _, _ := unstructured.NestedMap(pdb.Object, "spec")
	if fmt.Sprint(spec["maxUnavailable"]) != "1" || spec["minAvailable"] != nil {
		t.Errorf("PodDisruptionBudget spec %v, want maxUnavailable 1 only (a drain must not be blocked)", spec)
	}
	pdbSel, _, _ := unstructured.NestedStringMap(pdb.Object, "spec", "selector", "matchLabels")
	depSel, _, _ := unstructured.NestedStringMap(find(t, objs, "Deployment", "mpnbd-controller").Object, "spec", "selector", "matchLabels")
	if len(pdbSel) == 0 || fmt.Sprint(pdbSel) != fmt.Sprint(depSel) {
		t.Errorf("PodDisruptionBudget selects %v, the controller's pods are %v", pdbSel, depSel)
	}

	// Emptied: no priorityClassName, no budget.
	out, err := tryTemplate(t, "--set", "controller.podDisruptionBudget.enabled=false", "--set", "controller.priorityClassName=",
		"--set", "node.priorityClassName=", "--set", "datapath.priorityClassName=", "--set", "storageAgent.priorityClassName=")
	if err != nil {
		t.Fatal(err)
	}
	objs = parseObjects(t, out)
	for _, w := range workloads {
		if got, ok := podSpecField(t, find(t, objs, w.kind, w.name), "priorityClassName"); ok {
			t.Errorf("%s %s: priorityClassName %v, want none", w.kind, w.name, got)
		}
	}
	for _, o := range objs {
		if o.GetKind() == "PodDisruptionBudget" {
			t.Errorf("controller.podDisruptionBudget.enabled=false renders %s", objectKey(o))
		}
	}
}

// TestChartResources: every container's resources come from values, merged
// with the defaults as Helm merges maps (null clears them), and the
// defaults request CPU and memory everywhere, limit memory only where an
// OOM kill stalls no volume's I/O, and never limit CPU.
func TestChartResources(t *testing.T) {
	const (
		ctl   = "map[limits:map[memory:512Mi] requests:map[cpu:10m memory:32Mi]]"
		small = "map[limits:map[memory:64Mi] requests:map[cpu:5m memory:16Mi]]"
	)
	want := map[string]string{ // workload/container -> resources as values-custom.yaml sets them
		"Deployment/mpnbd-controller/controller":      "map[limits:map[memory:128Mi] requests:map[cpu:10m memory:32Mi]]",
		"Deployment/mpnbd-controller/csi-provisioner": "map[limits:map[memory:512Mi] requests:map[cpu:20m memory:48Mi]]",
		"Deployment/mpnbd-controller/liveness-probe":  "<nil>",
		"DaemonSet/mpnbd-node/node":                   "map[requests:map[cpu:50m memory:64Mi]]",
		"DaemonSet/mpnbd-node/node-driver-registrar":  "map[limits:map[memory:24Mi] requests:map[cpu:5m memory:16Mi]]",
		"DaemonSet/mpnbd-node/liveness-probe":         "<nil>",
		"DaemonSet/mpnbd-datapath/datapath":           "map[requests:map[cpu:200m memory:256Mi]]",
		"DaemonSet/mpnbd-storage-agent/storage-agent": "map[limits:map[cpu:2 memory:1Gi] requests:map[cpu:100m memory:128Mi]]",
		"Deployment/mpnbd-controller/csi-attacher":    ctl,
		"Deployment/mpnbd-controller/csi-resizer":     ctl,
		"Deployment/mpnbd-controller/csi-snapshotter": ctl,
	}
	seen := 0
	for _, c := range containers(t, parseObjects(t, customTemplate(t))) {
		w, ok := want[c.workload+"/"+c.name]
		if !ok {
			continue
		}
		seen++
		if got := fmt.Sprint(c.spec["resources"]); got != w {
			t.Errorf("%s container %s: resources %s, want %s", c.workload, c.name, got, w)
		}
	}
	if seen != len(want) {
		t.Errorf("found %d of the %d containers", seen, len(want))
	}
	defaults := map[string]string{
		"Deployment/mpnbd-controller/controller":      ctl,
		"Deployment/mpnbd-controller/csi-provisioner": ctl,
		"Deployment/mpnbd-controller/csi-attacher":    ctl,
		"Deployment/mpnbd-controller/csi-resizer":     ctl,
		"Deployment/mpnbd-controller/csi-snapshotter": ctl,
		"Deployment/mpnbd-controller/liveness-probe":  small,
		"DaemonSet/mpnbd-node/node":                   "map[requests:map[cpu:10m memory:32Mi]]",
		"DaemonSet/mpnbd-node/node-driver-registrar":  small,
		"DaemonSet/mpnbd-node/liveness-probe":         small,
		"DaemonSet/mpnbd-datapath/datapath":           "map[requests:map[cpu:100m memory:128Mi]]",
		"DaemonSet/mpnbd-storage-agent/storage-agent": "map[requests:map[cpu:100m memory:128Mi]]",
	}
	seen = 0
	for _, c := range containers(t, parseObjects(t, helmTemplate(t))) {
		key := c.workload + "/" + c.name
		w, ok := defaults[key]
		if !ok {
			t.Errorf("%s: a container this test does not know; give it default resources here", key)
			continue
		}
		seen++
		if got := fmt.Sprint(c.spec["resources"]); got != w {
			t.Errorf("%s: default resources %s, want %s", key, got, w)
		}
	}
	if seen != len(defaults) {
		t.Errorf("found %d of the %d containers in the default rendering", seen, len(defaults))
	}
}

// TestSelectorsNameTheRelease: every workload selects its pods by the
// release's instance label besides name and component, its pod template
// carries them, and the PDB selects the controller's pods the same way.
func TestSelectorsNameTheRelease(t *testing.T) {
	out := run(t, nil, helm(t), "template", "blue", "charts/mpnbd", "--namespace", "storage", "--kube-version", kubeVersion)
	n := 0
	for _, o := range parseObjects(t, out) {
		switch o.GetKind() {
		case "Deployment", "DaemonSet", "PodDisruptionBudget":
		default:
			continue
		}
		n++
		sel, _, _ := unstructured.NestedStringMap(o.Object, "spec", "selector", "matchLabels")
		if sel["app.kubernetes.io/instance"] != "blue" || sel["app.kubernetes.io/name"] != "mpnbd" || sel["app.kubernetes.io/component"] == "" {
			t.Errorf("%s selects %v, want name, component and instance=blue", objectKey(o), sel)
		}
		if o.GetKind() == "PodDisruptionBudget" {
			continue
		}
		tmpl, _, _ := unstructured.NestedStringMap(o.Object, "spec", "template", "metadata", "labels")
		for k, v := range sel {
			if tmpl[k] != v {
				t.Errorf("%s: its pod template's labels %v lack %s=%s of its selector", objectKey(o), tmpl, k, v)
			}
		}
		if l := o.GetLabels(); l["app.kubernetes.io/instance"] != "blue" || l["app.kubernetes.io/version"] == "" {
			t.Errorf("%s is labelled %v, want instance=blue and a version", objectKey(o), l)
		}
	}
	if n < 5 {
		t.Errorf("found %d workloads and PDBs, want controller, PDB, node, datapath, storage agent", n)
	}
}

// TestChartImage: the driver's image is REGISTRY/REPOSITORY:TAG (the tag
// the chart's appVersion by default), REGISTRY/REPOSITORY@DIGEST with a
// digest, and a repository that names a registry itself is used as it
// is, as the previous release's chart took it.
func TestChartImage(t *testing.T) {
	appVersion := chartFieldOf(t, "appVersion")
	digest := "sha256:" + strings.Repeat("ab", 32)
	for _, c := range []struct {
		args []string
		want string
	}{
		{nil, "ghcr.io/mpnbd/mpnbd:" + appVersion},
		{[]string{"--set", "image.tag=1.2.3"}, "ghcr.io/mpnbd/mpnbd:1.2.3"},
		{[]string{"--set", "image.digest=" + digest}, "ghcr.io/mpnbd/mpnbd@" + digest},
		{[]string{"--set", "image.registry=registry.example:5000"}, "registry.example:5000/mpnbd/mpnbd:" + appVersion},
		{[]string{"--set", "image.registry="}, "mpnbd/mpnbd:" + appVersion},
		{[]string{"--set", "image.repository=mpnbd.local/mpnbd", "--set", "image.tag=e2e"}, "mpnbd.local/mpnbd:e2e"},
		{[]string{"--set", "image.repository=localhost/mpnbd"}, "localhost/mpnbd:" + appVersion},
		{[]string{"--set", "image.repository=registry.example:5000/mpnbd"}, "registry.example:5000/mpnbd:" + appVersion},
		{[]string{"--set", "image.repository=team/mpnbd"}, "ghcr.io/team/mpnbd:" + appVersion},
	} {
		out, err := tryTemplate(t, c.args...)
		if err != nil {
			t.Errorf("helm template %q: %v", c.args, err)
			continue
		}
		seen := map[string]bool{}
		for _, o := range parseObjects(t, out) {
			for _, ctr := range containersOf(o) {
				if img, _ := ctr["image"].(string); strings.Contains(img, "mpnbd") && !strings.Contains(img, "sig-storage") {
					seen[img] = true
				}
			}
		}
		if len(seen) != 1 || !seen[c.want] {
			t.Errorf("helm template %q: the driver's image is %v, want only %s", c.args, seen, c.want)
		}
	}
}

// chartFieldOf reads a top-level field of the chart's Chart.yaml.
func chartFieldOf(t *testing.T, field string) string {
	b, err := os.ReadFile(filepath.Join(repoRoot(t), "charts", "mpnbd", "Chart.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, field+":"); ok {
			return strings.Trim(strings.TrimSpace(v), `"`)
		}
	}
	t.Fatalf("Chart.yaml has no %s", field)
	return ""
}

// containersOf returns the init and main containers of a workload or Job.
func containersOf(o *unstructured.Unstructured) []map[string]any {
	var out []map[string]any
	for _, path := range [][]string{
		{"spec", "template", "spec", "containers"}, {"spec", "template", "spec", "initContainers"},
		{"spec", "containers"}, {"spec", "initContainers"},
	} {
		list, _, _ := unstructured.NestedSlice(o.Object, path...)
		for _, c := range list {
			if m, ok := c.(map[string]any); ok {
				out = append(out, m)
			}
		}
	}
	return out
}
