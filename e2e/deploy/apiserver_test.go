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
	"context"
	"encoding/json"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"

	"github.com/mpnbd/mpnbd/internal/testenv/apiserver"
)

// monitoringGroup's CRDs (Prometheus Operator) are not installed in the
// test API server; objects of it are checked locally only.
const monitoringGroup = "monitoring.coreos.com"

// TestServerDryRun applies the kustomize tree and the chart (default and
// non-default values) with a server-side dry run against a real API
// server with our CRDs: every object must pass the server's validation
// and admission.
func TestServerDryRun(t *testing.T) {
	kust := parseObjects(t, kustomizeDeploy(t))
	chartDefault := parseObjects(t, helmTemplate(t))
	chartCustom := parseObjects(t, customTemplate(t))
	kc := kubectl(t)

	cfg, c := apiserver.Start(t)
	kubeconfig := apiserver.WriteKubeconfig(t, cfg)
	ctx := context.Background()
	// A dry run creates nothing, so the objects' namespaces must exist.
	for _, ns := range []string{"mpnbd-system", "storage-mpnbd"} {
		err := c.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}})
		if err != nil && !apierrors.IsAlreadyExists(err) {
			t.Fatal(err)
		}
	}

	for _, tc := range []struct {
		name string
		objs []*unstructured.Unstructured
	}{
		{"kustomize", kust},
		{"chart-defaults", chartDefault},
		{"chart-custom", chartCustom},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var stream bytes.Buffer
			n := 0
			for _, o := range tc.objs {
				if o.GroupVersionKind().Group == monitoringGroup {
					t.Logf("not applied (no %s CRDs in the test API server): %s", monitoringGroup, objectKey(o))
					continue
				}
				b, err := json.Marshal(o.Object)
				if err != nil {
					t.Fatal(err)
				}
				stream.WriteString("---\n")
				stream.Write(b)
				stream.WriteString("\n")
				n++
			}
			out := run(t, &stream, kc, "--kubeconfig", kubeconfig, "apply", "--dry-run=server", "-f", "-")
			// One "... (server dry run)" line per object.
			if got := strings.Count(string(out), "(server dry run)"); got != n {
				t.Errorf("kubectl apply --dry-run=server: %d objects reported, want %d:\n%s", got, n, out)
			}
		})
	}

	// The dry run must be able to fail: an object the server rejects.
	bad := `{"apiVersion":"storage.k8s.io/v1","kind":"CSIDriver","metadata":{"name":"nbd.mptcp.mpnbd.io"},"spec":{"fsGroupPolicy":"Sometimes"}}`
	if out, err := tryRun(t, strings.NewReader(bad), kc, "--kubeconfig", kubeconfig, "apply", "--dry-run=server", "-f", "-"); err == nil {
		t.Errorf("an invalid CSIDriver passed the server dry run:\n%s", out)
	}
}

// TestNotesWarnOfRestrictedNamespace: installed into a namespace whose Pod
// Security level refuses privileged pods, the release's notes say so and
// how to allow them; into one that allows them, they do not (helm install
// --dry-run=server looks the namespace up on a real API server).
func TestNotesWarnOfRestrictedNamespace(t *testing.T) {
	cfg, c := apiserver.Start(t)
	kubeconfig := apiserver.WriteKubeconfig(t, cfg)
	ctx := context.Background()
	for ns, level := range map[string]string{"storage-baseline": "baseline", "storage-privileged": "privileged"} {
		err := c.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns,
			Labels: map[string]string{"pod-security.kubernetes.io/enforce": level}}})
		if err != nil && !apierrors.IsAlreadyExists(err) {
			t.Fatal(err)
		}
	}
	warning := `WARNING: namespace storage-baseline enforces the Pod Security level "baseline"`
	for ns, want := range map[string]bool{"storage-baseline": true, "storage-privileged": false} {
		out := string(run(t, nil, helm(t), "install", "mpnbd", "charts/mpnbd", "--namespace", ns, "--kubeconfig", kubeconfig,
			"--dry-run=server", "--set", "crds.install=false")) // the test server has the CRDs
		if !strings.Contains(out, "Namespace "+ns+" holds:") {
			t.Fatalf("helm install --dry-run=server -n %s printed no notes for the namespace:\n%s", ns, out)
		}
		if got := strings.Contains(out, "WARNING: namespace"); got != want {
			t.Errorf("namespace %s: the notes warn of its Pod Security level: %v, want %v:\n%s", ns, got, want, out)
		}
		if want && !strings.Contains(out, warning) {
			t.Errorf("the notes lack %q:\n%s", warning, out)
		}
	}
}
