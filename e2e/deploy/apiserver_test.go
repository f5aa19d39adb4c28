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

	"github.com/mpnbd/mpnbd/e2e/apiserver"
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
	chartCustom := parseObjects(t, helmTemplate(t, "e2e/deploy/testdata/values-custom.yaml"))
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
