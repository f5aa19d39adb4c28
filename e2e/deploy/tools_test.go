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
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"testing"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"

	"github.com/mpnbd/mpnbd/internal/testenv/repo"
)

// requireEnv makes a missing tool a failure instead of a skip.
const requireEnv = "MPNBD_DEPLOY_REQUIRE"

// unavailable skips t, or fails it when requireEnv is set.
func unavailable(t testing.TB, format string, args ...any) {
	t.Helper()
	msg := fmt.Sprintf(format, args...)
	if os.Getenv(requireEnv) == "1" {
		t.Fatalf("%s=1 but: %s", requireEnv, msg)
	}
	fmt.Fprintf(os.Stderr, "deploy: skipping: %s\n", msg)
	t.Skip(msg)
}

func repoRoot(t testing.TB) string {
	t.Helper()
	root, err := repo.Root()
	if err != nil {
		t.Fatal(err)
	}
	return root
}

var (
	helmOnce sync.Once
	helmPath string
	helmErr  error
)

// helm returns the helm binary hack/tools.sh builds and caches.
func helm(t testing.TB) string {
	t.Helper()
	root := repoRoot(t)
	helmOnce.Do(func() {
		cmd := exec.Command("bash", filepath.Join(root, "hack", "tools.sh"))
		cmd.Dir = root
		var stdout, stderr bytes.Buffer
		cmd.Stdout, cmd.Stderr = &stdout, &stderr
		if err := cmd.Run(); err != nil {
			helmErr = fmt.Errorf("hack/tools.sh: %w: %s", err, strings.TrimSpace(stderr.String()))
			return
		}
		sc := bufio.NewScanner(&stdout)
		for sc.Scan() {
			if v, ok := strings.CutPrefix(sc.Text(), "HELM="); ok {
				helmPath = v
			}
		}
		if helmPath == "" {
			helmErr = fmt.Errorf("hack/tools.sh printed no HELM=: %q", stdout.String())
		}
	})
	if helmErr != nil {
		unavailable(t, "no helm: %v", helmErr)
	}
	return helmPath
}

// kubectl returns a kubectl from $PATH, else the one hack/kube-binaries.sh
// may have cached.
func kubectl(t testing.TB) string {
	t.Helper()
	if p, err := exec.LookPath("kubectl"); err == nil {
		return p
	}
	cache := os.Getenv("MPNBD_KUBE_CACHE")
	if cache == "" {
		cache = "/var/cache/mpnbd/kube"
	}
	matches, _ := filepath.Glob(filepath.Join(cache, "*", "bin", "kubectl"))
	sort.Strings(matches)
	if len(matches) > 0 {
		return matches[len(matches)-1]
	}
	unavailable(t, "no kubectl on $PATH or in %s (KUBE_BINARIES=kubectl hack/kube-binaries.sh builds one)", cache)
	return ""
}

// run runs a command in the repository root and returns its stdout.
func run(t testing.TB, stdin io.Reader, name string, args ...string) []byte {
	t.Helper()
	out, err := tryRun(t, stdin, name, args...)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

func tryRun(t testing.TB, stdin io.Reader, name string, args ...string) ([]byte, error) {
	t.Helper()
	cmd := exec.Command(name, args...)
	cmd.Dir = repoRoot(t)
	cmd.Stdin = stdin
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		return stdout.Bytes(), fmt.Errorf("%s %s: %w\nstdout:\n%s\nstderr:\n%s",
			filepath.Base(name), strings.Join(args, " "), err, stdout.String(), stderr.String())
	}
	return stdout.Bytes(), nil
}

// kustomizeDeploy renders deploy/.
func kustomizeDeploy(t testing.TB) []byte {
	t.Helper()
	return run(t, nil, kubectl(t), "kustomize", "deploy")
}

// kubeVersion is the Kubernetes version the chart is rendered for: the
// cluster suite's (hack/kube-binaries.sh). The helm hack/tools.sh builds
// from the module proxy assumes v1.20 (helm's release builds set the
// version with -ldflags), which the chart's kubeVersion refuses.
const kubeVersion = "1.34.4"

// tryTemplate renders the chart (release mpnbd in namespace mpnbd-system)
// with more helm arguments (--set, --values, --namespace, --show-only...).
func tryTemplate(t testing.TB, args ...string) ([]byte, error) {
	t.Helper()
	return tryRun(t, nil, helm(t), append([]string{"template", "mpnbd", "charts/mpnbd", "--namespace", "mpnbd-system",
		"--kube-version", kubeVersion}, args...)...)
}

// helmTemplate renders the chart with the given values files (none: the
// defaults), CRDs included.
func helmTemplate(t testing.TB, valueFiles ...string) []byte {
	t.Helper()
	args := []string{"--include-crds"}
	for _, f := range valueFiles {
		args = append(args, "--values", f)
	}
	out, err := tryTemplate(t, args...)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// customValues sets every knob of the chart to something other than its
// default; the tests render it as a release in customNamespace.
const (
	customValues    = "e2e/deploy/testdata/values-custom.yaml"
	customNamespace = "storage-mpnbd"
)

// customTemplate renders the chart with customValues in customNamespace.
func customTemplate(t testing.TB) []byte {
	t.Helper()
	out, err := tryTemplate(t, "--values", customValues, "--namespace", customNamespace)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// parseObjects decodes a multi-document YAML stream; empty documents are
// skipped.
func parseObjects(t testing.TB, data []byte) []*unstructured.Unstructured {
	t.Helper()
	objs, err := decodeObjects(data)
	if err != nil {
		t.Fatal(err)
	}
	return objs
}

func decodeObjects(data []byte) ([]*unstructured.Unstructured, error) {
	dec := utilyaml.NewYAMLOrJSONDecoder(bytes.NewReader(data), 4096)
	var out []*unstructured.Unstructured
	for {
		var m map[string]any
		err := dec.Decode(&m)
		if errors.Is(err, io.EOF) {
			return out, nil
		}
		if err != nil {
			return nil, fmt.Errorf("decoding manifests: %w", err)
		}
		if len(m) == 0 {
			continue
		}
		u := &unstructured.Unstructured{Object: m}
		if u.GetKind() == "" || u.GetName() == "" {
			return nil, fmt.Errorf("object without kind or name: %v", m)
		}
		out = append(out, u)
	}
}

// objectKey names an object uniquely within a rendering.
func objectKey(u *unstructured.Unstructured) string {
	return u.GroupVersionKind().GroupKind().String() + " " + u.GetNamespace() + "/" + u.GetName()
}

// find returns the object of kind and name, or fails t.
func find(t testing.TB, objs []*unstructured.Unstructured, kind, name string) *unstructured.Unstructured {
	t.Helper()
	for _, o := range objs {
		if o.GetKind() == kind && o.GetName() == name {
			return o
		}
	}
	t.Fatalf("no %s %s in the rendered objects", kind, name)
	return nil
}
