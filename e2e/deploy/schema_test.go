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
	"encoding/json"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
)

// schemaError starts helm's message for values its schema refuses.
const schemaError = "don't meet the specifications of the schema"

// TestValuesSchemaRejects: charts/mpnbd/values.schema.json refuses an
// unknown key (a typo), at the top and nested, a wrong type and a value
// outside an enum, each with an error that names where.
func TestValuesSchemaRejects(t *testing.T) {
	for _, tc := range []struct {
		name string
		args []string
		want []string // in helm's error
	}{
		{"unknown top-level key", []string{"--set", "colour=blue"}, []string{"'colour'"}},
		{"unknown nested key", []string{"--set", "node.storageNic=eth1"}, []string{"/node", "'storageNic'"}},
		{"unknown key deep down", []string{"--set", "sidecars.livenessProbe.resource.limits.cpu=10m"},
			[]string{"/sidecars/livenessProbe", "'resource'"}},
		{"unknown StorageClass parameter", []string{"--set", "storageClasses[0].name=c", "--set", "storageClasses[0].parameters.colour=blue"},
			[]string{"/storageClasses/0/parameters", "'colour'"}},
		{"wrong type", []string{"--set", "node.maxVolumes=lots"}, []string{"/node/maxVolumes", "integer"}},
		{"string for a number", []string{"--set-string", "controller.replicas=2"}, []string{"/controller/replicas", "integer"}},
		{"string for a list", []string{"--set", "node.storageNICs=eth1"}, []string{"/node/storageNICs", "array"}},
		{"log level", []string{"--set", "logLevel=verbose"}, []string{"/logLevel"}},
		{"transport", []string{"--set", "node.transports={warp}"}, []string{"/node/transports/0"}},
		{"fsType", []string{"--set", "storageClasses[0].name=c", "--set", "storageClasses[0].fsType=btrfs"},
			[]string{"/storageClasses/0/fsType"}},
		{"PodDisruptionBudget", []string{"--set", "controller.podDisruptionBudget.maxUnavailable=half"},
			[]string{"/controller/podDisruptionBudget/maxUnavailable"}},
		{"snapshot deletion policy", []string{"--set", "snapshots.volumeSnapshotClass.deletionPolicy=Keep"},
			[]string{"/snapshots/volumeSnapshotClass/deletionPolicy"}},
		{"default encryption", []string{"--set", "defaultEncryption=always"}, []string{"/defaultEncryption"}},
		// HTTP endpoints bind to the pod IP or to every address; the host's
		// IP is no address of a pod network, a list no address at all.
		{"HTTP address from the host", []string{"--set", "httpAddressFrom=status.hostIP"}, []string{"/httpAddressFrom"}},
		{"HTTP address from a list", []string{"--set", "httpAddressFrom=status.podIPs"}, []string{"/httpAddressFrom"}},
		{"HTTP address literal", []string{"--set", "httpAddressFrom=10.0.0.1"}, []string{"/httpAddressFrom"}},
		{"encryption parameter", []string{"--set", "storageClasses[0].name=c", "--set", "storageClasses[0].parameters.encryption=yes"},
			[]string{"/storageClasses/0/parameters/encryption"}},
		{"replicas", []string{"--set", "storageClasses[0].name=c", "--set", "storageClasses[0].replicas=4"},
			[]string{"/storageClasses/0/replicas"}},
		{"replicas parameter", []string{"--set", "storageClasses[0].name=c", "--set-string", "storageClasses[0].parameters.replicas=two"},
			[]string{"/storageClasses/0/parameters/replicas"}},
		{"image digest", []string{"--set", "image.digest=sha256:abc"}, []string{"/image/digest"}},
		{"image registry with a path", []string{"--set", "image.registry=ghcr.io/mpnbd"}, []string{"/image/registry"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := tryTemplate(t, tc.args...)
			if err == nil {
				t.Fatalf("helm template %q passed", tc.args)
			}
			msg := err.Error()
			if !strings.Contains(msg, schemaError) {
				t.Fatalf("helm template %q failed, but not on the schema: %v", tc.args, err)
			}
			for _, w := range tc.want {
				if !strings.Contains(msg, w) {
					t.Errorf("helm's error does not name %s: %v", w, err)
				}
			}
		})
	}
}

// TestValuesSchemaAccepts: the defaults and every set of values the
// repository installs or renders the chart with pass the schema.
func TestValuesSchemaAccepts(t *testing.T) {
	for _, args := range [][]string{
		nil,
		{"--values", "e2e/deploy/testdata/values-custom.yaml"},
		{"--values", "e2e/deploy/testdata/values-no-datapath.yaml"},
		{"--values", "e2e/deploy/testdata/values-cluster.yaml"},
		// README.md, charts/mpnbd/README.md and docs/installation.md.
		{"--set", "storageAgent.signalNICs={eth2,eth3,eth4}"},
		{"--set", "node.storageNICs={eth1,eth2,eth3,eth4}", "--set", "storageAgent.signalNICs={eth1,eth2,eth3,eth4}"},
		{"--namespace", "storage", "--set", "crds.install=false"},
		{"--set", "node.metricsPort=9811", "--set", "monitoring.podMonitors.node.enabled=true",
			"--set", "monitoring.podMonitors.storageAgent.enabled=true",
			"--set", "monitoring.podMonitors.additionalLabels.release=kube-prometheus-stack",
			"--set", "monitoring.prometheusRule.enabled=true",
			"--set", "monitoring.prometheusRule.additionalLabels.release=kube-prometheus-stack",
			"--set", "monitoring.grafanaDashboard.enabled=true", "--set", "monitoring.grafanaDashboard.namespace=monitoring"},
		// Every HTTP endpoint on every address.
		{"--set", "httpAddressFrom="},
		// TestChartRefusesAgentWithoutAddresses.
		{"--set", "storageAgent.storageAddressesFrom=", "--set", "storageAgent.enabled=false"},
		// What --set makes of numbers, and emptied defaults.
		{"--set", "apiServer.host=10.0.0.1", "--set", "apiServer.port=6443", "--set", "image.tag=2"},
		{"--set", "controller.podDisruptionBudget.enabled=false", "--set", "controller.priorityClassName=",
			"--set", "node.priorityClassName=", "--set", "storageClasses=null", "--set", "storageAgent.nodeSelector=null"},
	} {
		if _, err := tryTemplate(t, args...); err != nil {
			t.Errorf("helm template %q: %v", args, err)
		}
	}
}

// TestValuesSchemaMatchesValuesFile: the schema declares the keys of each
// non-empty map of values.yaml, no fewer (which the defaults passing the
// schema proves) and no more (a key the schema allows but values.yaml
// neither sets nor documents).
func TestValuesSchemaMatchesValuesFile(t *testing.T) {
	root := repoRoot(t)
	var schema map[string]any
	b, err := os.ReadFile(filepath.Join(root, "charts/mpnbd/values.schema.json"))
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(b, &schema); err != nil {
		t.Fatalf("values.schema.json: %v", err)
	}
	if s := schema["$schema"]; s != "http://json-schema.org/draft-07/schema#" {
		t.Errorf("$schema %v, want draft-07", s)
	}
	var values map[string]any
	b, err = os.ReadFile(filepath.Join(root, "charts/mpnbd/values.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	if err := utilyaml.Unmarshal(b, &values); err != nil {
		t.Fatalf("values.yaml: %v", err)
	}
	defs, _ := schema["definitions"].(map[string]any)
	// resolve follows a local $ref.
	resolve := func(s map[string]any) map[string]any {
		if ref, ok := s["$ref"].(string); ok {
			def, _ := defs[strings.TrimPrefix(ref, "#/definitions/")].(map[string]any)
			return def
		}
		return s
	}
	objects := 0
	var walk func(path string, s map[string]any, v map[string]any)
	walk = func(path string, s map[string]any, v map[string]any) {
		// Kubernetes' own types: values.yaml sets some of their keys.
		switch s["$ref"] {
		case "#/definitions/resources", "#/definitions/affinity", "#/definitions/tolerations", "#/definitions/nodeSelector":
			return
		}
		s = resolve(s)
		props, ok := s["properties"].(map[string]any)
		if !ok || len(v) == 0 {
			return // a free-form map (nodeSelector, labels) or an empty one
		}
		objects++
		if s["additionalProperties"] != false {
			t.Errorf("%s: the schema allows unknown keys (additionalProperties is not false)", path)
		}
		for k := range props {
			if _, ok := v[k]; !ok && (path != "" || k != "global") {
				t.Errorf("%s.%s: in the schema, not in values.yaml", path, k)
			}
		}
		for k, e := range v {
			ps, ok := props[k].(map[string]any)
			if !ok {
				t.Errorf("%s.%s: in values.yaml, not in the schema", path, k)
				continue
			}
			if m, ok := e.(map[string]any); ok {
				walk(path+"."+k, ps, m)
			}
		}
	}
	walk("", schema, values)
	if objects < 10 {
		t.Errorf("walked only %d objects of values.yaml", objects)
	}
}

// TestStorageClassEncryption: the chart's classes carry no encryption of
// their own; defaultEncryption reaches the controller
// (--default-encryption), which gives it to volumes of classes that name
// none, so a class renders the same whatever the default (an upgrade
// never has to change a class, whose parameters cannot change). A class
// naming its own keeps it; a class whose transport cannot encrypt is
// refused with a message naming it while the encryption is required, by
// the class or by the default.
func TestStorageClassEncryption(t *testing.T) {
	params := func(objs []*unstructured.Unstructured, name string) map[string]string {
		t.Helper()
		p, _, _ := unstructured.NestedStringMap(find(t, objs, "StorageClass", name).Object, "parameters")
		return p
	}
	controllerArg := func(objs []*unstructured.Unstructured) string {
		t.Helper()
		for _, c := range containers(t, objs) {
			if c.name == "controller" {
				if v, ok := argValue(c.args, "default-encryption"); ok {
					return v
				}
			}
		}
		return ""
	}
	byDefault := map[string]map[string]string{}
	for _, def := range []string{"required", "preferred", "none"} {
		objs := render(t, "--set", "defaultEncryption="+def)
		if got := controllerArg(objs); got != def {
			t.Errorf("defaultEncryption=%s: the controller's --default-encryption is %q", def, got)
		}
		for _, sc := range []string{"mpnbd-ext4", "mpnbd-xfs", "mpnbd-block", "mpnbd-replicated"} {
			p := params(objs, sc)
			if _, ok := p["encryption"]; ok {
				t.Errorf("defaultEncryption=%s: %s parameters %v: want no encryption in the class", def, sc, p)
			}
			if prev, ok := byDefault[sc]; ok && !maps.Equal(prev, p) {
				t.Errorf("%s renders %v with defaultEncryption=%s, %v with required", sc, p, def, prev)
			}
			byDefault[sc] = p
		}
	}
	if got := controllerArg(render(t)); got != "required" {
		t.Errorf("by default the controller's --default-encryption is %q, want required", got)
	}
	objs := render(t, "--set", "storageClasses[0].name=c", "--set", "storageClasses[0].parameters.encryption=preferred",
		"--set", "storageClasses[0].parameters.transport=kernel")
	if p := params(objs, "c"); p["encryption"] != "preferred" || p["transport"] != "kernel" {
		t.Errorf("a class's own encryption: parameters %v", p)
	}
	if _, err := tryTemplate(t, "--set", "storageClasses[0].name=k", "--set", "storageClasses[0].parameters.transport=kernel",
		"--set", "defaultEncryption=none"); err != nil {
		t.Errorf("a kernel class with defaultEncryption none: %v", err)
	}
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"--set", "storageClasses[0].parameters.transport=kernel"}, "storageClasses k: transport kernel cannot encrypt (the kernel's NBD client holds the connections) and encryption is required (defaultEncryption)"},
		{[]string{"--set", "storageClasses[0].parameters.transport=tcp", "--set", "storageClasses[0].parameters.encryption=required", "--set", "defaultEncryption=none"},
			"storageClasses k: transport tcp cannot encrypt (the kernel's NBD client holds the connections) and the class requires encryption"},
	} {
		_, err := tryTemplate(t, append([]string{"--set", "storageClasses[0].name=k"}, c.args...)...)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%v: %v, want an error saying %q", c.args, err, c.want)
		}
	}
}

// TestStorageClassesAsPreviousRelease: with default values, every class
// the previous release's chart made renders with the same parameters,
// reclaim policy and binding mode from this chart, so that a helm upgrade
// (which would have to change a class, and Kubernetes refuses) goes
// through; and no template but NOTES.txt asks the cluster (lookup), so
// that a render without a cluster (helm template, Argo CD, Flux) is what
// an install gets.
func TestStorageClassesAsPreviousRelease(t *testing.T) {
	prev, err := filepath.Glob(filepath.Join(repoRoot(t), "e2e", "cluster", "testdata", "mpnbd-*.tgz"))
	if err != nil || len(prev) != 1 {
		t.Fatalf("want one e2e/cluster/testdata/mpnbd-*.tgz (the previous release's chart), found %v (%v)", prev, err)
	}
	out, err := tryRun(t, nil, helm(t), "template", "mpnbd", prev[0], "--namespace", "mpnbd-system", "--kube-version", kubeVersion)
	if err != nil {
		t.Fatal(err)
	}
	old := parseObjects(t, out)
	now := render(t)
	compared := 0
	for _, o := range old {
		if o.GetKind() != "StorageClass" {
			continue
		}
		n := find(t, now, "StorageClass", o.GetName())
		for _, field := range []string{"parameters", "provisioner", "reclaimPolicy", "volumeBindingMode"} {
			a, _, _ := unstructured.NestedFieldNoCopy(o.Object, field)
			b, _, _ := unstructured.NestedFieldNoCopy(n.Object, field)
			if fmt.Sprint(a) != fmt.Sprint(b) {
				t.Errorf("StorageClass %s %s: %v from %s, %v now: a helm upgrade would have to change it", o.GetName(), field, a, filepath.Base(prev[0]), b)
			}
		}
		compared++
	}
	if compared < 3 {
		t.Errorf("compared %d classes of %s, want its three", compared, filepath.Base(prev[0]))
	}
	templates, err := filepath.Glob(filepath.Join(repoRoot(t), "charts", "mpnbd", "templates", "*"))
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range templates {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		if filepath.Base(f) != "NOTES.txt" && strings.Contains(string(b), "lookup ") {
			t.Errorf("%s asks the cluster (lookup): a render without a cluster would differ from an install", filepath.Base(f))
		}
	}
}
