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
	"os"
	"path/filepath"
	"strings"
	"testing"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
)

// renderNotes renders templates/NOTES.txt with more helm arguments.
// helm template does not print the notes and helm install --dry-run needs
// a cluster, so it renders a copy of the chart in which a ConfigMap holds
// the notes' text.
func renderNotes(t *testing.T, args ...string) string {
	t.Helper()
	chart := filepath.Join(t.TempDir(), "mpnbd")
	if err := os.CopyFS(chart, os.DirFS(filepath.Join(repoRoot(t), "charts", "mpnbd"))); err != nil {
		t.Fatal(err)
	}
	notes, err := os.ReadFile(filepath.Join(chart, "templates", "NOTES.txt"))
	if err != nil {
		t.Fatal(err)
	}
	for name, text := range map[string]string{
		"_notes_test.tpl": `{{- define "notesTest" -}}` + string(notes) + `{{- end }}`,
		"notes-test.yaml": "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: notes\ndata:\n  notes: {{ include \"notesTest\" . | quote }}\n",
	} {
		if err := os.WriteFile(filepath.Join(chart, "templates", name), []byte(text), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	out := run(t, nil, helm(t), append([]string{"template", "mpnbd", chart, "--kube-version", kubeVersion,
		"--namespace", "mpnbd-system", "--show-only", "templates/notes-test.yaml"}, args...)...)
	objs := parseObjects(t, out)
	if len(objs) != 1 {
		t.Fatalf("%d objects rendered, want the notes' ConfigMap", len(objs))
	}
	text, _, _ := unstructured.NestedString(objs[0].Object, "data", "notes")
	return text
}

// TestChartNotes: after helm install, the notes name what the release's
// values installed (StorageClasses, namespace, the storage-node label)
// and how to look at the driver's objects.
func TestChartNotes(t *testing.T) {
	for _, tc := range []struct {
		name        string
		args        []string
		want, never []string
	}{
		{"defaults", nil,
			[]string{"Namespace mpnbd-system", "mpnbd-ext4: fsType ext4", "mpnbd-xfs: fsType xfs", "mpnbd-block",
				"mpnbd-replicated: fsType ext4, transport auto, 2 replicas",
				"kubectl label node <node> mpnbd.io/storage-node=true", "kubectl get pods -n mpnbd-system",
				"kubectl get nbdnode", "kubectl get nbdvol", "PodDisruptionBudget mpnbd-controller: maxUnavailable 1",
				"DaemonSet mpnbd-datapath", "DaemonSet mpnbd-storage-agent", "300Mi", "No storage NICs",
				"WARNING: the cluster does not serve snapshot.storage.k8s.io/v1", "node plugin metrics: http://<node>:9811/metrics", "mpnbdctl volumes"},
			[]string{"the default class", "ServiceMonitor", "PodMonitor", "MPTCP endpoints:", "VolumeSnapshotClass mpnbd-snapshots"}},
		{"snapshot API served", []string{"--api-versions", "snapshot.storage.k8s.io/v1/VolumeSnapshotClass"},
			[]string{"VolumeSnapshotClass mpnbd-snapshots (the driver's default): VolumeSnapshots"},
			[]string{"does not serve snapshot.storage.k8s.io"}},
		{"custom", []string{"--values", "e2e/deploy/testdata/values-custom.yaml", "--namespace", "storage-mpnbd"},
			[]string{"Namespace storage-mpnbd", "fast-xfs: fsType xfs, transport relay, the default class",
				"raw-tcp: fsType xfs, transport tcp", "kubectl label node <node> storage.example.com/pool=fast",
				"kubectl get pods -n storage-mpnbd", "ServiceMonitor mpnbd-storage-agent", "maxUnavailable 50%",
				"subflow endpoints on eth1, eth2, 10.10.3.0/24", "signal endpoints on eth1, eth2", ":19810/metrics",
				"PrometheusRule mpnbd: alerts", "PodMonitor mpnbd-node: the node plugins' metrics (port 19810)",
				"ConfigMap mpnbd-grafana-dashboard: the Grafana dashboard"},
			[]string{"mpnbd-system", "mpnbd-ext4", "mpnbd.io/storage-node", "No storage NICs", "PodMonitor mpnbd-storage-agent", "(in namespace"}},
		{"parts off", []string{"--set", "storageAgent.enabled=false", "--set", "datapath.enabled=false",
			"--set", "controller.podDisruptionBudget.enabled=false", "--set", "snapshots.enabled=false",
			"--set", "storageClasses[0].name=only-ext4", "--set", "storageClasses[0].fsType=ext4", "--set", "node.metricsPort=0"},
			[]string{"only-ext4: fsType ext4", "runs no storage agent"},
			[]string{"mpnbd-datapath", "mpnbd-storage-agent", "PodDisruptionBudget", "kubectl label", "300Mi", "mpnbd-xfs", "napshot", "metrics"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			notes := renderNotes(t, tc.args...)
			for _, w := range tc.want {
				if !strings.Contains(notes, w) {
					t.Errorf("notes lack %q:\n%s", w, notes)
				}
			}
			for _, n := range tc.never {
				if strings.Contains(notes, n) {
					t.Errorf("notes mention %q:\n%s", n, notes)
				}
			}
		})
	}
}
