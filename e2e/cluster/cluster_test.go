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

package cluster

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"
)

// RequireEnv makes missing prerequisites a failure instead of a skip.
const RequireEnv = "MPNBD_CLUSTER_REQUIRE"

// KubeBin is where hack/kube-binaries.sh caches the Kubernetes binaries.
func KubeBin() string {
	if d := os.Getenv("MPNBD_KUBE_BIN"); d != "" {
		return d
	}
	return "/var/cache/mpnbd/kube/v1.34.4/bin"
}

func requireCluster(t *testing.T) {
	t.Helper()
	skip := func(why string) {
		if os.Getenv(RequireEnv) == "1" {
			t.Fatalf("cluster required (%s=1): %s", RequireEnv, why)
		}
		t.Skip(why)
	}
	if runtime.GOOS != "linux" || os.Geteuid() != 0 {
		skip("the cluster suite needs root on Linux")
	}
	for _, b := range []string{"kubelet", "kube-scheduler", "kube-controller-manager", "kube-apiserver", "kubectl"} {
		if _, err := os.Stat(filepath.Join(KubeBin(), b)); err != nil {
			skip(b + " is not built: run KUBE_BINARIES='kube-apiserver kube-controller-manager kube-scheduler kubelet kubectl' hack/kube-binaries.sh")
		}
	}
}

// TestClusterUpDown brings the cluster up, runs a pod on it and takes it
// down again, checking the host is left as it was.
func TestClusterUpDown(t *testing.T) {
	requireCluster(t)
	dir := t.TempDir()
	before := hostState(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	c, down := upForTest(ctx, t, "cluster", Config{Dir: dir, KubeBin: KubeBin(), Log: testLog{t}})
	defer down()
	// Pods reach the API server at the pod bridge's gateway address.
	hc, err := c.httpClient()
	if err != nil {
		t.Fatal(err)
	}
	if resp, err := hc.Get("https://" + PodGateway + ":6443/readyz"); err != nil || resp.StatusCode != 200 {
		t.Fatalf("API server at %s: %v %v", PodGateway, resp, err)
	}
	pod := `apiVersion: v1
kind: Pod
metadata: {name: smoke, namespace: default}
spec:
  containers:
  - {name: pause, image: ` + PauseImage + `, imagePullPolicy: Never}
`
	if out, err := kubectlStdin(ctx, c, pod, "apply", "-f", "-"); err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	if _, err := c.Kubectl(ctx, "wait", "--for=condition=Ready", "pod/smoke", "--timeout=120s"); err != nil {
		t.Fatalf("pod not ready: %v\nkubelet: %s", err, c.LogTail("kubelet", 30))
	}
	if _, err := c.Kubectl(ctx, "delete", "pod", "smoke", "--wait=true", "--timeout=60s"); err != nil {
		t.Fatal(err)
	}
	down()
	if after := hostState(t); after != before {
		t.Errorf("the host changed:\nbefore: %s\nafter:  %s", before, after)
	}
	if out, _ := exec.Command("sh", "-c", "grep -c "+dir+" /proc/self/mountinfo").Output(); strings.TrimSpace(string(out)) != "0" {
		t.Errorf("mounts left under %s", dir)
	}
}

// upForTest brings a cluster up for a test and logs how long it took
// (what names it); the function returned takes it down, once however
// often it is called (deferred, and where the test checks the host).
func upForTest(ctx context.Context, t *testing.T, what string, cfg Config) (*Cluster, func()) {
	t.Helper()
	start := time.Now()
	c, err := Up(ctx, cfg)
	if err != nil {
		t.Fatalf("up: %v", err)
	}
	t.Logf("%s up in %v", what, time.Since(start).Round(time.Millisecond))
	var once sync.Once
	return c, func() {
		once.Do(func() {
			if err := c.Down(); err != nil {
				t.Errorf("down: %v", err)
			}
		})
	}
}

// hostState summarises what the cluster may change on the host.
func hostState(t *testing.T) string {
	var b strings.Builder
	for _, k := range []string{"vm/overcommit_memory", "kernel/panic", "kernel/panic_on_oops"} {
		v, _ := os.ReadFile("/proc/sys/" + k)
		b.WriteString(k + "=" + strings.TrimSpace(string(v)) + " ")
	}
	ns, _ := exec.Command("ip", "netns", "list").Output()
	for _, l := range strings.Split(string(ns), "\n") {
		if strings.HasPrefix(l, "cni-") || strings.HasPrefix(l, "mpnbd-") {
			b.WriteString("netns " + strings.Fields(l)[0] + " ")
		}
	}
	ipt, _ := exec.Command("iptables", "-S").Output()
	for _, l := range strings.Split(string(ipt), "\n") {
		if strings.Contains(l, "KUBE-") {
			b.WriteString(l + "; ")
		}
	}
	if err := exec.Command("ip", "link", "show", "mpnbd-e2e0").Run(); err == nil {
		b.WriteString("bridge mpnbd-e2e0 ")
	}
	links, _ := exec.Command("ip", "-o", "link", "show").Output()
	for _, l := range strings.Split(string(links), "\n") {
		if f := strings.Fields(l); len(f) > 1 && (strings.Contains(l, "mpe2e") || strings.HasPrefix(f[1], nodeLinkPrefix)) {
			b.WriteString("link " + strings.Fields(l)[1] + " ")
		}
	}
	limits, _ := exec.Command("ip", "mptcp", "limits", "show").Output()
	b.WriteString("mptcp limits: " + strings.TrimSpace(string(limits)))
	return b.String()
}

func kubectlStdin(ctx context.Context, c *Cluster, stdin string, args ...string) (string, error) {
	cmd := exec.CommandContext(ctx, filepath.Join(KubeBin(), "kubectl"), append([]string{"--kubeconfig", c.Kubeconfig}, args...)...)
	cmd.Stdin = strings.NewReader(stdin)
	out, err := cmd.CombinedOutput()
	return string(out), err
}

type testLog struct{ t *testing.T }

func (l testLog) Write(p []byte) (int, error) {
	l.t.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}
