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
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"unicode"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
)

// rulesTestFile holds promtool's unit tests of the chart's alerts; its
// rule_files names renderedRulesFile, which TestPrometheusRules writes
// beside a copy of it.
const (
	rulesTestFile     = "e2e/deploy/testdata/prometheus-rules.test.yaml"
	renderedRulesFile = "mpnbd-rules.yaml"
)

// chartAlerts are the alerts the chart ships, by name: their severity.
var chartAlerts = map[string]string{
	"MpnbdVolumeInaccessible":      "critical",
	"MpnbdVolumeDegraded":          "warning",
	"MpnbdVolumeReconnectStorm":    "warning",
	"MpnbdStorageNodeNearlyFull":   "warning",
	"MpnbdStorageNodeUnreachable":  "critical",
	"MpnbdStorageAgentDown":        "critical",
	"MpnbdStorageAgentsNotScraped": "warning",
	"MpnbdVolumeRequestErrors":     "warning",
	"MpnbdVolumeSlowRequests":      "warning",
	"MpnbdConnectionLimitHit":      "warning",
	"MpnbdCertificateNotRenewed":   "warning",
}

// runbookBase is where every alert's runbook_url points: a heading of
// docs/operations.md, by GitHub's anchor for it.
const runbookBase = "https://github.com/mpnbd/mpnbd/blob/main/docs/operations.md#"

// promtool returns Debian's promtool (package prometheus), or skips.
func promtool(t testing.TB) string {
	t.Helper()
	if p, err := exec.LookPath("promtool"); err == nil {
		return p
	}
	if _, err := os.Stat("/usr/bin/promtool"); err == nil {
		return "/usr/bin/promtool"
	}
	unavailable(t, "no promtool (apt-get install --no-install-recommends prometheus; hack/install-deps.sh does)")
	return ""
}

// renderOnly renders one template of the chart with more helm arguments.
func renderOnly(t testing.TB, template string, args ...string) []*unstructured.Unstructured {
	t.Helper()
	out, err := tryTemplate(t, append([]string{"--show-only", template}, args...)...)
	if err != nil {
		t.Fatal(err)
	}
	return parseObjects(t, out)
}

// ruleGroups renders the chart's PrometheusRule (enabled, with more helm
// arguments) and returns it and its rule groups.
func ruleGroups(t testing.TB, args ...string) (*unstructured.Unstructured, []any) {
	t.Helper()
	objs := renderOnly(t, "templates/prometheusrule.yaml", append([]string{"--set", "monitoring.prometheusRule.enabled=true"}, args...)...)
	if len(objs) != 1 || objs[0].GetKind() != "PrometheusRule" || objs[0].GetAPIVersion() != "monitoring.coreos.com/v1" {
		t.Fatalf("rendered %d objects, want one monitoring.coreos.com/v1 PrometheusRule", len(objs))
	}
	groups, ok, _ := unstructured.NestedSlice(objs[0].Object, "spec", "groups")
	if !ok || len(groups) == 0 {
		t.Fatalf("PrometheusRule without groups: %v", objs[0].Object)
	}
	return objs[0], groups
}

// alertRules returns the alerting rules of groups by alert name.
func alertRules(t testing.TB, groups []any) map[string]map[string]any {
	t.Helper()
	out := map[string]map[string]any{}
	for _, g := range groups {
		rules, _, _ := unstructured.NestedSlice(g.(map[string]any), "rules")
		for _, r := range rules {
			rm := r.(map[string]any)
			name, _ := rm["alert"].(string)
			if name == "" {
				t.Errorf("a rule without an alert name: %v", rm)
				continue
			}
			if _, dup := out[name]; dup {
				t.Errorf("alert %s is defined twice", name)
			}
			out[name] = rm
		}
	}
	return out
}

// TestPrometheusRules renders the rule groups the chart ships (default
// thresholds), checks them with `promtool check rules` and runs the unit
// tests of rulesTestFile on them with `promtool test rules`. Every alert
// has a severity, a summary and a description, and uses only metrics and
// labels the code exports.
func TestPrometheusRules(t *testing.T) {
	pt := promtool(t)
	_, groups := ruleGroups(t)
	rules := alertRules(t, groups)
	known := exportedMetrics(t)
	known["up"] = nil // Prometheus's own, per target
	anchors := docAnchors(t, "docs/operations.md")
	var names []string
	for name, r := range rules {
		names = append(names, name)
		labels, _, _ := unstructured.NestedStringMap(r, "labels")
		if want, ok := chartAlerts[name]; !ok || labels["severity"] != want {
			t.Errorf("alert %s: severity %q, want %q", name, labels["severity"], want)
		}
		ann, _, _ := unstructured.NestedStringMap(r, "annotations")
		if ann["summary"] == "" || ann["description"] == "" {
			t.Errorf("alert %s: annotations %v, want a summary and a description", name, ann)
		}
		if anchor, ok := strings.CutPrefix(ann["runbook_url"], runbookBase); !ok || !anchors[anchor] {
			t.Errorf("alert %s: runbook_url %q, want %s and a heading of docs/operations.md (headings: %v)", name, ann["runbook_url"], runbookBase, anchors)
		}
		expr, _ := r["expr"].(string)
		for _, p := range checkPromQL(known, expr, "") {
			t.Errorf("alert %s: %s", name, p)
		}
	}
	if len(names) != len(chartAlerts) {
		t.Errorf("alerts %v, want %d: %v", names, len(chartAlerts), chartAlerts)
	}

	dir := t.TempDir()
	rulesJSON, err := json.MarshalIndent(map[string]any{"groups": groups}, "", "  ")
	if err != nil {
		t.Fatal(err)
	}
	// JSON is YAML: promtool reads it as a rule file.
	if err := os.WriteFile(filepath.Join(dir, renderedRulesFile), rulesJSON, 0o644); err != nil {
		t.Fatal(err)
	}
	tests, err := os.ReadFile(filepath.Join(repoRoot(t), rulesTestFile))
	if err != nil {
		t.Fatal(err)
	}
	testFile := filepath.Join(dir, filepath.Base(rulesTestFile))
	if err := os.WriteFile(testFile, tests, 0o644); err != nil {
		t.Fatal(err)
	}
	for _, args := range [][]string{
		{"check", "rules", filepath.Join(dir, renderedRulesFile)},
		{"test", "rules", testFile},
	} {
		out, err := exec.Command(pt, args...).CombinedOutput()
		t.Logf("promtool %s:\n%s", strings.Join(args[:2], " "), out)
		if err != nil {
			t.Errorf("promtool %s: %v\n%s", strings.Join(args, " "), err, out)
		}
	}
	// Each alert has a test that expects it to fire.
	for name := range chartAlerts {
		if !bytes.Contains(tests, []byte("alertname: "+name+"\n        exp_alerts:")) {
			t.Errorf("%s: no test of %s firing", rulesTestFile, name)
		}
	}
}

// TestPrometheusRuleValues: the thresholds and labels of
// monitoring.prometheusRule reach the rendered rules.
func TestPrometheusRuleValues(t *testing.T) {
	rule, groups := ruleGroups(t, "--set", "monitoring.prometheusRule.reconnectStormThreshold=12",
		"--set-json", "monitoring.prometheusRule.storageNodeFullPercent=92.5",
		"--set-json", "monitoring.prometheusRule.requestLatencySeconds=0.25",
		"--set", "monitoring.prometheusRule.additionalLabels.release=kube-prometheus-stack")
	rules := alertRules(t, groups)
	for name, want := range map[string]string{
		"MpnbdVolumeReconnectStorm":  "increase(mpnbd_node_volume_reconnects_total[10m]) > 12",
		"MpnbdStorageNodeNearlyFull": "100 * (1 - mpnbd_server_available_bytes / mpnbd_server_capacity_bytes) > 92.5",
		"MpnbdVolumeSlowRequests": `histogram_quantile(0.99, sum by (export, node, instance, job, le) (rate(mpnbd_server_request_duration_seconds_bucket{cmd=~"read|write"}[5m]))) > 0.25
and on (export, node, instance, job)
sum by (export, node, instance, job) (rate(mpnbd_server_request_duration_seconds_count{cmd=~"read|write"}[5m])) > 1
`,
	} {
		if got := rules[name]["expr"]; got != want {
			t.Errorf("alert %s: expr %q, want %q", name, got, want)
		}
	}
	for name, threshold := range map[string]string{
		"MpnbdVolumeReconnectStorm": "more than 12 times",
		"MpnbdVolumeSlowRequests":   "above 0.25s",
	} {
		desc, _, _ := unstructured.NestedString(rules[name], "annotations", "description")
		if !strings.Contains(desc, threshold) {
			t.Errorf("%s description does not name the threshold (%q): %s", name, threshold, desc)
		}
	}
	if l := rule.GetLabels(); l["release"] != "kube-prometheus-stack" || l["app.kubernetes.io/name"] != "mpnbd" {
		t.Errorf("PrometheusRule labels %v", l)
	}
	if rule.GetNamespace() != "mpnbd-system" {
		t.Errorf("PrometheusRule in %q, want the driver's namespace", rule.GetNamespace())
	}
	for _, args := range [][]string{
		{"--set", "monitoring.prometheusRule.storageNodeFullPercent=0"},
		{"--set", "monitoring.prometheusRule.storageNodeFullPercent=120"},
		{"--set", "monitoring.prometheusRule.reconnectStormThreshold=-1"},
		{"--set", "monitoring.prometheusRule.requestLatencySeconds=0"},
		{"--set", "monitoring.prometheusRule.requestLatencySeconds=-0.5"},
		{"--set", "monitoring.prometheusRule.requestLatencySeconds=10"},
		{"--set", "monitoring.prometheusRule.requestLatencySeconds=fast"},
		{"--set", "monitoring.prometheusRule.threshold=5"},
	} {
		if _, err := tryTemplate(t, args...); err == nil || !strings.Contains(err.Error(), schemaError) {
			t.Errorf("helm template %q: %v, want the schema to refuse it", args, err)
		}
	}
}

// TestMonitoringOffByDefault: with default values the chart renders no
// monitoring.coreos.com object (the API servers without those CRDs would
// refuse it) and no dashboard.
func TestMonitoringOffByDefault(t *testing.T) {
	for _, o := range parseObjects(t, helmTemplate(t)) {
		if o.GroupVersionKind().Group == monitoringGroup || o.GetLabels()["grafana_dashboard"] != "" {
			t.Errorf("default values render %s", objectKey(o))
		}
	}
}

// containerPort returns the containerPort of the named port of a
// workload's container.
func containerPort(t *testing.T, objs []*unstructured.Unstructured, kind, name, ctr, port string) (int64, bool) {
	t.Helper()
	for _, c := range containers(t, []*unstructured.Unstructured{find(t, objs, kind, name)}) {
		if c.name != ctr {
			continue
		}
		ports, _, _ := unstructured.NestedSlice(c.spec, "ports")
		for _, p := range ports {
			pm := p.(map[string]any)
			if pm["name"] == port {
				switch n := pm["containerPort"].(type) {
				case int64:
					return n, true
				case float64:
					return int64(n), true
				}
				t.Fatalf("%s %s container %s: port %s: containerPort %v", kind, name, ctr, port, pm["containerPort"])
			}
		}
	}
	return 0, false
}

// containerArgs returns the args of a workload's container.
func containerArgs(t *testing.T, objs []*unstructured.Unstructured, kind, name, ctr string) []string {
	t.Helper()
	for _, c := range containers(t, []*unstructured.Unstructured{find(t, objs, kind, name)}) {
		if c.name == ctr {
			return c.args
		}
	}
	t.Fatalf("%s %s has no container %s", kind, name, ctr)
	return nil
}

// TestPodMonitors: each PodMonitor selects the pods of its workload, in
// its namespace, on the port named metrics their container declares (the
// node plugin's node.metricsPort, the agent's metrics.port, the
// controller's controller.metricsPort), and labels the series with the
// node; values that cannot work are refused.
func TestPodMonitors(t *testing.T) {
	args := []string{"--set", "monitoring.podMonitors.node.enabled=true", "--set", "monitoring.podMonitors.storageAgent.enabled=true",
		"--set", "monitoring.podMonitors.controller.enabled=true",
		"--set", "node.metricsPort=9811", "--set", "monitoring.podMonitors.interval=15s",
		"--set", "monitoring.podMonitors.additionalLabels.release=kube-prometheus-stack"}
	out, err := tryTemplate(t, args...)
	if err != nil {
		t.Fatal(err)
	}
	objs := parseObjects(t, out)
	for _, tc := range []struct {
		monitor, kind, daemonSet, container string
		port                                int64
	}{
		{"mpnbd-node", "DaemonSet", "mpnbd-node", "node", 9811},
		{"mpnbd-storage-agent", "DaemonSet", "mpnbd-storage-agent", "storage-agent", 9810},
		{"mpnbd-controller", "Deployment", "mpnbd-controller", "controller", 9818},
	} {
		pm := find(t, objs, "PodMonitor", tc.monitor)
		if pm.GetAPIVersion() != "monitoring.coreos.com/v1" || pm.GetNamespace() != "mpnbd-system" ||
			pm.GetLabels()["release"] != "kube-prometheus-stack" {
			t.Errorf("PodMonitor %s: %s in %q, labels %v", tc.monitor, pm.GetAPIVersion(), pm.GetNamespace(), pm.GetLabels())
		}
		ds := find(t, objs, tc.kind, tc.daemonSet)
		sel, _, _ := unstructured.NestedStringMap(pm.Object, "spec", "selector", "matchLabels")
		podLabels, _, _ := unstructured.NestedStringMap(ds.Object, "spec", "template", "metadata", "labels")
		for k, v := range sel {
			if podLabels[k] != v {
				t.Errorf("PodMonitor %s selects %v; the pods of %s have %v", tc.monitor, sel, tc.daemonSet, podLabels)
			}
		}
		if len(sel) == 0 {
			t.Errorf("PodMonitor %s selects every pod", tc.monitor)
		}
		nsSel, _, _ := unstructured.NestedStringSlice(pm.Object, "spec", "namespaceSelector", "matchNames")
		if !slices.Equal(nsSel, []string{ds.GetNamespace()}) {
			t.Errorf("PodMonitor %s: namespaces %v, its pods are in %s", tc.monitor, nsSel, ds.GetNamespace())
		}
		eps, _, _ := unstructured.NestedSlice(pm.Object, "spec", "podMetricsEndpoints")
		if len(eps) != 1 {
			t.Fatalf("PodMonitor %s: endpoints %v", tc.monitor, eps)
		}
		ep := eps[0].(map[string]any)
		if ep["port"] != "metrics" || ep["path"] != "/metrics" || ep["interval"] != "15s" {
			t.Errorf("PodMonitor %s: endpoint %v", tc.monitor, ep)
		}
		if n, ok := containerPort(t, objs, tc.kind, tc.daemonSet, tc.container, "metrics"); !ok || n != tc.port {
			t.Errorf("%s container %s: port metrics %d (declared: %v), want %d", tc.daemonSet, tc.container, n, ok, tc.port)
		}
		relabel := fmt.Sprint(ep["relabelings"])
		if !strings.Contains(relabel, "__meta_kubernetes_pod_node_name") || !strings.Contains(relabel, "targetLabel:node") {
			t.Errorf("PodMonitor %s does not set the label node: %s", tc.monitor, relabel)
		}
	}

	// No metrics port, no port declared, no flag.
	if _, ok := containerPort(t, render(t, "--set", "node.metricsPort=0"), "DaemonSet", "mpnbd-node", "node", "metrics"); ok {
		t.Error("the node plugin declares a metrics port without node.metricsPort")
	}
	off := render(t, "--set", "controller.metricsPort=0")
	if _, ok := containerPort(t, off, "Deployment", "mpnbd-controller", "controller", "metrics"); ok {
		t.Error("the controller declares a metrics port without controller.metricsPort")
	}
	if args := containerArgs(t, off, "Deployment", "mpnbd-controller", "controller"); slices.ContainsFunc(args, func(a string) bool { return strings.HasPrefix(a, "--metrics-addr") }) {
		t.Errorf("the controller serves metrics without controller.metricsPort: %v", args)
	}
	// The controller's metrics on by default, on the pod's address.
	if args := containerArgs(t, render(t), "Deployment", "mpnbd-controller", "controller"); !slices.Contains(args, "--metrics-addr=[$(HTTP_ADDRESS)]:9818") {
		t.Errorf("the controller's arguments by default: %v", args)
	}
	// Without the storage agent, no PodMonitor for it.
	out, err = tryTemplate(t, "--set", "monitoring.podMonitors.storageAgent.enabled=true", "--set", "storageAgent.enabled=false")
	if err != nil {
		t.Fatal(err)
	}
	for _, o := range parseObjects(t, out) {
		if o.GetKind() == "PodMonitor" {
			t.Errorf("storageAgent.enabled=false renders %s", objectKey(o))
		}
	}
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--set", "monitoring.podMonitors.node.enabled=true", "--set", "node.metricsPort=0"}, "node.metricsPort"},
		{[]string{"--set", "monitoring.podMonitors.controller.enabled=true", "--set", "controller.metricsPort=0"}, "controller.metricsPort"},
		{[]string{"--set", "monitoring.podMonitors.storageAgent.enabled=true", "--set", "metrics.serviceMonitor.enabled=true"},
			"choose one"},
		{[]string{"--set", "monitoring.podMonitors.interval=soon"}, schemaError},
	} {
		if _, err := tryTemplate(t, tc.args...); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("helm template %q: %v, want an error naming %q", tc.args, err, tc.want)
		}
	}
}

// dashboardFile is the Grafana dashboard the chart ships.
const dashboardFile = "charts/mpnbd/dashboards/mpnbd.json"

// dashboard is the part of Grafana's dashboard model the test reads.
type dashboard struct {
	Title      string           `json:"title"`
	UID        string           `json:"uid"`
	Panels     []dashboardPanel `json:"panels"`
	Templating struct {
		List []struct {
			Name  string `json:"name"`
			Type  string `json:"type"`
			Query any    `json:"query"`
		} `json:"list"`
	} `json:"templating"`
}

type dashboardPanel struct {
	ID         int    `json:"id"`
	Type       string `json:"type"`
	Title      string `json:"title"`
	Datasource *struct {
		UID string `json:"uid"`
	} `json:"datasource"`
	Targets []struct {
		Expr         string `json:"expr"`
		LegendFormat string `json:"legendFormat"`
		Datasource   *struct {
			UID string `json:"uid"`
		} `json:"datasource"`
	} `json:"targets"`
	Panels []dashboardPanel `json:"panels"` // a collapsed row's
}

// TestGrafanaDashboard: every query of every panel of the dashboard (and
// of its variables) names only metrics and labels the code exports, on
// the dashboard's data source variable; the dashboard shows throughput
// (per volume and per path), latency, subflows, reconnects and capacity.
func TestGrafanaDashboard(t *testing.T) {
	b, err := os.ReadFile(filepath.Join(repoRoot(t), dashboardFile))
	if err != nil {
		t.Fatal(err)
	}
	var d dashboard
	dec := json.NewDecoder(bytes.NewReader(b))
	if err := dec.Decode(&d); err != nil {
		t.Fatalf("%s: %v", dashboardFile, err)
	}
	if d.Title == "" || d.UID == "" {
		t.Errorf("dashboard title %q, uid %q", d.Title, d.UID)
	}
	known := exportedMetrics(t)
	used := map[string]bool{}
	vars := map[string]bool{}
	for _, v := range d.Templating.List {
		vars[v.Name] = true
		q, _ := v.Query.(string)
		if v.Type != "query" {
			continue
		}
		m := regexp.MustCompile(`^label_values\(\s*([a-z_:][a-z0-9_:]*)\s*,\s*([a-z_][a-z0-9_]*)\s*\)$`).FindStringSubmatch(q)
		if m == nil {
			t.Errorf("variable %s: query %q is not label_values(metric, label)", v.Name, q)
			continue
		}
		labels, ok := known[m[1]]
		if !ok || !slices.Contains(labels, m[2]) {
			t.Errorf("variable %s: %s has no label %s (the code's metric has %v, exported: %v)", v.Name, m[1], m[2], labels, ok)
		}
		used[m[1]] = true
	}
	if !vars["datasource"] {
		t.Error("no datasource variable: the dashboard would be bound to one Prometheus")
	}
	ids := map[int]bool{}
	var walk func([]dashboardPanel)
	walk = func(ps []dashboardPanel) {
		for _, p := range ps {
			if ids[p.ID] {
				t.Errorf("panel %q: id %d used twice", p.Title, p.ID)
			}
			ids[p.ID] = true
			walk(p.Panels)
			if p.Type == "row" {
				continue
			}
			if len(p.Targets) == 0 {
				t.Errorf("panel %q has no query", p.Title)
			}
			if p.Datasource == nil || p.Datasource.UID != "${datasource}" {
				t.Errorf("panel %q: data source %v, want ${datasource}", p.Title, p.Datasource)
			}
			for _, tg := range p.Targets {
				if tg.Datasource == nil || tg.Datasource.UID != "${datasource}" {
					t.Errorf("panel %q: a query's data source %v, want ${datasource}", p.Title, tg.Datasource)
				}
				for _, problem := range checkPromQL(known, tg.Expr, tg.LegendFormat) {
					t.Errorf("panel %q: %s: %s", p.Title, tg.Expr, problem)
				}
				if refs, err := parsePromQL(tg.Expr); err == nil {
					for _, m := range refs.metrics {
						used[m] = true
					}
				}
			}
		}
	}
	walk(d.Panels)
	// What the dashboard is for: throughput (per volume and per path),
	// latency, subflows (connected vs expected), reconnects, capacity.
	for _, m := range []string{"mpnbd_server_read_bytes_total", "mpnbd_server_written_bytes_total",
		"mpnbd_server_request_duration_seconds_bucket", "mpnbd_node_volume_subflows", "mpnbd_node_volume_expected_subflows",
		"mpnbd_node_volume_path_sent_bytes_total", "mpnbd_node_volume_path_received_bytes_total",
		"mpnbd_node_volume_reconnects_total", "mpnbd_server_capacity_bytes", "mpnbd_server_available_bytes"} {
		if !used[m] {
			t.Errorf("no panel shows %s", m)
		}
	}
	t.Logf("%s: %d panels, metrics %d of the %d the code exports", dashboardFile, len(ids), len(used), len(known))
}

// TestGrafanaDashboardConfigMap: with monitoring.grafanaDashboard.enabled
// the chart renders the dashboard, unchanged, in a ConfigMap the Grafana
// sidecar loads.
func TestGrafanaDashboardConfigMap(t *testing.T) {
	want, err := os.ReadFile(filepath.Join(repoRoot(t), dashboardFile))
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name, namespace string
		args            []string
	}{
		{"defaults", "mpnbd-system", nil},
		{"elsewhere", "monitoring", []string{"--set", "monitoring.grafanaDashboard.namespace=monitoring",
			"--set", "monitoring.grafanaDashboard.annotations.grafana_folder=Storage",
			"--set", "monitoring.grafanaDashboard.additionalLabels.team=storage"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			objs := renderOnly(t, "templates/grafana-dashboard.yaml", append([]string{"--set", "monitoring.grafanaDashboard.enabled=true"}, tc.args...)...)
			if len(objs) != 1 || objs[0].GetKind() != "ConfigMap" {
				t.Fatalf("rendered %d objects, want a ConfigMap", len(objs))
			}
			cm := objs[0]
			if cm.GetLabels()["grafana_dashboard"] != "1" || cm.GetNamespace() != tc.namespace {
				t.Errorf("ConfigMap %s in %q, labels %v; want label grafana_dashboard=1 in %s", cm.GetName(), cm.GetNamespace(), cm.GetLabels(), tc.namespace)
			}
			if tc.args != nil && (cm.GetAnnotations()["grafana_folder"] != "Storage" || cm.GetLabels()["team"] != "storage") {
				t.Errorf("ConfigMap annotations %v, labels %v", cm.GetAnnotations(), cm.GetLabels())
			}
			got, _, _ := unstructured.NestedString(cm.Object, "data", "mpnbd.json")
			if strings.TrimSpace(got) != strings.TrimSpace(string(want)) {
				t.Errorf("the ConfigMap's mpnbd.json differs from %s", dashboardFile)
			}
		})
	}
}

// docAnchors are the anchors GitHub gives the headings of a Markdown file
// of the repository: lower case, spaces as dashes, other punctuation
// dropped.
func docAnchors(t testing.TB, file string) map[string]bool {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(repoRoot(t), file))
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]bool{}
	for _, l := range strings.Split(string(b), "\n") {
		h, ok := strings.CutPrefix(l, "#")
		if !ok {
			continue
		}
		h = strings.TrimSpace(strings.TrimLeft(h, "#"))
		var a strings.Builder
		for _, r := range strings.ToLower(h) {
			switch {
			case r == ' ':
				a.WriteRune('-')
			case r == '-' || r == '_' || unicode.IsLetter(r) || unicode.IsDigit(r):
				a.WriteRune(r)
			}
		}
		out[a.String()] = true
	}
	return out
}
