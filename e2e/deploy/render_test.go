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
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/util/version"
)

// helmOnlyLabels are the labels the chart adds to identify its release;
// the kustomize tree has none of them.
var helmOnlyLabels = []string{
	"helm.sh/chart",
	"app.kubernetes.io/managed-by",
	"app.kubernetes.io/instance",
	"app.kubernetes.io/version",
}

// helmOnlyAnnotations are the annotations the chart adds for Helm: its
// CRDs are kept by helm uninstall.
var helmOnlyAnnotations = []string{"helm.sh/resource-policy"}

// normalize drops what may differ between the two renderings without
// changing the object (Helm's labels, null fields) and returns the object
// as indented JSON (sorted keys), keyed by objectKey.
func normalize(t testing.TB, objs []*unstructured.Unstructured) map[string]string {
	t.Helper()
	out := map[string]string{}
	for _, o := range objs {
		o = o.DeepCopy()
		if labels := o.GetLabels(); labels != nil {
			for _, l := range helmOnlyLabels {
				delete(labels, l)
			}
			o.SetLabels(labels)
		}
		if ann := o.GetAnnotations(); ann != nil {
			for _, a := range helmOnlyAnnotations {
				delete(ann, a)
			}
			o.SetAnnotations(ann)
		}
		obj := dropNulls(o.Object).(map[string]any)
		b, err := json.MarshalIndent(obj, "", "  ")
		if err != nil {
			t.Fatal(err)
		}
		k := objectKey(o)
		if _, dup := out[k]; dup {
			t.Fatalf("%s is rendered twice", k)
		}
		out[k] = string(b)
	}
	return out
}

func dropNulls(v any) any {
	switch v := v.(type) {
	case map[string]any:
		m := map[string]any{}
		for k, e := range v {
			if e != nil {
				m[k] = dropNulls(e)
			}
		}
		return m
	case []any:
		s := make([]any, 0, len(v))
		for _, e := range v {
			s = append(s, dropNulls(e))
		}
		return s
	}
	return v
}

// lineDiff is a unified-style diff of two texts (LCS over lines), good
// enough for one object.
func lineDiff(a, b string) string {
	x, y := strings.Split(a, "\n"), strings.Split(b, "\n")
	lcs := make([][]int, len(x)+1)
	for i := range lcs {
		lcs[i] = make([]int, len(y)+1)
	}
	for i := len(x) - 1; i >= 0; i-- {
		for j := len(y) - 1; j >= 0; j-- {
			if x[i] == y[j] {
				lcs[i][j] = lcs[i+1][j+1] + 1
			} else {
				lcs[i][j] = max(lcs[i+1][j], lcs[i][j+1])
			}
		}
	}
	var sb strings.Builder
	i, j := 0, 0
	for i < len(x) || j < len(y) {
		switch {
		case i < len(x) && j < len(y) && x[i] == y[j]:
			sb.WriteString("  " + x[i] + "\n")
			i, j = i+1, j+1
		case j < len(y) && (i == len(x) || lcs[i][j+1] >= lcs[i+1][j]):
			sb.WriteString("+ " + y[j] + "\n")
			j++
		default:
			sb.WriteString("- " + x[i] + "\n")
			i++
		}
	}
	return sb.String()
}

// compareRenderings reports every object only one side has and every
// object that differs, with a diff (- want, + got).
func compareRenderings(want, got map[string]string) []string {
	var problems []string
	var keys []string
	for k := range want {
		keys = append(keys, k)
	}
	for k := range got {
		if _, ok := want[k]; !ok {
			keys = append(keys, k)
		}
	}
	slices.Sort(keys)
	for _, k := range keys {
		w, inWant := want[k]
		g, inGot := got[k]
		switch {
		case !inGot:
			problems = append(problems, "missing: "+k)
		case !inWant:
			problems = append(problems, "extra: "+k)
		case w != g:
			problems = append(problems, "differs: "+k+"\n"+lineDiff(w, g))
		}
	}
	return problems
}

// TestChartDefaultsMatchKustomize: the chart with default values,
// installed as release mpnbd in namespace mpnbd-system, renders the
// objects of deploy/, the same names and the same specs, but the
// Namespace: the chart installs into the release's namespace, which Helm
// or the user creates.
func TestChartDefaultsMatchKustomize(t *testing.T) {
	var kust []*unstructured.Unstructured
	for _, o := range parseObjects(t, kustomizeDeploy(t)) {
		if o.GetKind() == "Namespace" {
			if o.GetName() != "mpnbd-system" {
				t.Errorf("deploy/ has the Namespace %s, not mpnbd-system", o.GetName())
			}
			continue
		}
		kust = append(kust, o)
	}
	var chart []*unstructured.Unstructured
	for _, o := range parseObjects(t, helmTemplate(t)) {
		if _, hook := o.GetAnnotations()["helm.sh/hook"]; !hook { // Helm's alone (uninstall-check)
			chart = append(chart, o)
		}
	}
	if len(kust) < 20 {
		t.Fatalf("kubectl kustomize deploy rendered only %d objects", len(kust))
	}
	for _, p := range compareRenderings(normalize(t, kust), normalize(t, chart)) {
		t.Errorf("chart vs deploy/ (- deploy/, + chart): %s", p)
	}
}

// TestCompareRenderingsFindsDifferences makes sure the comparison above
// can fail.
func TestCompareRenderingsFindsDifferences(t *testing.T) {
	obj := func(name, image string) *unstructured.Unstructured {
		return &unstructured.Unstructured{Object: map[string]any{
			"apiVersion": "apps/v1", "kind": "Deployment",
			"metadata": map[string]any{"name": name, "namespace": "ns",
				"labels": map[string]any{"helm.sh/chart": "x-1", "app.kubernetes.io/name": "mpnbd"}},
			"spec": map[string]any{"image": image, "empty": nil},
		}}
	}
	a := normalize(t, []*unstructured.Unstructured{obj("a", "img:1"), obj("b", "img:1")})
	b := normalize(t, []*unstructured.Unstructured{obj("a", "img:2"), obj("c", "img:1")})
	got := compareRenderings(a, b)
	if len(got) != 3 || !strings.HasPrefix(got[0], "differs: ") || !strings.Contains(got[0], `-     "image": "img:1"`) ||
		!strings.Contains(got[0], `+     "image": "img:2"`) || got[1] != "missing: Deployment.apps ns/b" || got[2] != "extra: Deployment.apps ns/c" {
		t.Errorf("compareRenderings = %q", got)
	}
	same := normalize(t, []*unstructured.Unstructured{obj("a", "img:1")})
	o := obj("a", "img:1")
	o.SetLabels(map[string]string{"app.kubernetes.io/name": "mpnbd"})
	if p := compareRenderings(same, normalize(t, []*unstructured.Unstructured{o})); len(p) != 0 {
		t.Errorf("Helm's labels and nulls are not ignored: %q", p)
	}
}

// TestHelmLint: the chart lints without warnings or errors, with the
// default and the test values.
func TestHelmLint(t *testing.T) {
	h := helm(t)
	for _, args := range [][]string{
		{"lint", "charts/mpnbd", "--strict", "--kube-version", kubeVersion},
		{"lint", "charts/mpnbd", "--strict", "--kube-version", kubeVersion, "--values", "e2e/deploy/testdata/values-custom.yaml"},
	} {
		out := run(t, nil, h, args...)
		if bytes.Contains(out, []byte("[WARNING]")) || bytes.Contains(out, []byte("[ERROR]")) {
			t.Errorf("helm %s:\n%s", strings.Join(args, " "), out)
		}
	}
}

// TestChartCRDsMatchDeploy: the chart ships the generated CRDs of
// deploy/crds unchanged (hack/generate.sh writes both).
func TestChartCRDsMatchDeploy(t *testing.T) {
	root := repoRoot(t)
	names := func(dir string) []string {
		m, err := filepath.Glob(filepath.Join(root, dir, "*.yaml"))
		if err != nil {
			t.Fatal(err)
		}
		for i := range m {
			m[i] = filepath.Base(m[i])
		}
		slices.Sort(m)
		return m
	}
	want, got := names("deploy/crds"), names("charts/mpnbd/files/crds")
	if len(want) == 0 || !slices.Equal(want, got) {
		t.Fatalf("deploy/crds has %v, charts/mpnbd/files/crds has %v; run hack/generate.sh", want, got)
	}
	for _, n := range want {
		a, err := os.ReadFile(filepath.Join(root, "deploy/crds", n))
		if err != nil {
			t.Fatal(err)
		}
		b, err := os.ReadFile(filepath.Join(root, "charts/mpnbd/files/crds", n))
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(a, b) {
			t.Errorf("charts/mpnbd/files/crds/%s differs from deploy/crds/%s; run hack/generate.sh", n, n)
		}
	}
}

// TestPreviousReleaseChart: the cluster suite upgrades from the previous
// release's packaged chart (e2e/cluster/testdata/mpnbd-<version>.tgz):
// exactly one, older than this chart, and it still renders.
func TestPreviousReleaseChart(t *testing.T) {
	root := repoRoot(t)
	m, _ := filepath.Glob(filepath.Join(root, "e2e", "cluster", "testdata", "mpnbd-*.tgz"))
	if len(m) != 1 {
		t.Fatalf("want one e2e/cluster/testdata/mpnbd-*.tgz, found %v", m)
	}
	h := helm(t)
	chartVersion := func(chart string) *version.Version {
		t.Helper()
		out := run(t, nil, h, "show", "chart", chart)
		for _, l := range strings.Split(string(out), "\n") {
			if v, ok := strings.CutPrefix(l, "version: "); ok {
				sv, err := version.ParseSemantic(strings.TrimSpace(v))
				if err != nil {
					t.Fatalf("%s: version %q: %v", chart, v, err)
				}
				return sv
			}
		}
		t.Fatalf("%s has no version:\n%s", chart, out)
		return nil
	}
	prev, cur := chartVersion(m[0]), chartVersion(filepath.Join(root, "charts", "mpnbd"))
	if !prev.LessThan(cur) {
		t.Errorf("the previous release's chart %s is version %s, not older than charts/mpnbd's %s", filepath.Base(m[0]), prev, cur)
	}
	if want := "mpnbd-" + prev.String() + ".tgz"; filepath.Base(m[0]) != want {
		t.Errorf("%s holds version %s; name it %s", filepath.Base(m[0]), prev, want)
	}
	run(t, nil, h, "template", "mpnbd", m[0], "--namespace", "storage", "--kube-version", kubeVersion)
}
