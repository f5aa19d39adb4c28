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
	"slices"
	"strings"
	"testing"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
)

// sidecarValues maps each CSI sidecar of the chart's values
// (sidecars.<key>) to the containers that run it.
var sidecarValues = map[string][]string{
	"provisioner":         {"Deployment/mpnbd-controller/csi-provisioner"},
	"attacher":            {"Deployment/mpnbd-controller/csi-attacher"},
	"resizer":             {"Deployment/mpnbd-controller/csi-resizer"},
	"snapshotter":         {"Deployment/mpnbd-controller/csi-snapshotter"},
	"nodeDriverRegistrar": {"DaemonSet/mpnbd-node/node-driver-registrar"},
	"livenessProbe":       {"Deployment/mpnbd-controller/liveness-probe", "DaemonSet/mpnbd-node/liveness-probe"},
}

// TestSidecarExtraArgs: sidecars.<sidecar>.extraArgs end the args of each
// container running that sidecar, and every container the chart renders
// that does not run one of our commands is such a sidecar (a sidecar added
// later needs its extraArgs too).
func TestSidecarExtraArgs(t *testing.T) {
	var args []string
	for key := range sidecarValues {
		args = append(args, "--set-json", "sidecars."+key+`.extraArgs=["--kube-api-qps=7","--`+strings.ToLower(key)+`-extra"]`)
	}
	cs := containers(t, render(t, args...))
	mine := ours(t, cs)
	seen := map[string]bool{}
	for _, c := range cs {
		key := c.workload + "/" + c.name
		our := false
		for _, list := range mine {
			our = our || slices.ContainsFunc(list, func(o container) bool { return o.workload == c.workload && o.name == c.name })
		}
		if our {
			continue
		}
		var sidecar string
		for k, list := range sidecarValues {
			if slices.Contains(list, key) {
				sidecar = k
			}
		}
		if sidecar == "" {
			t.Errorf("%s: a sidecar container this test does not know; give it extraArgs and add it to sidecarValues", key)
			continue
		}
		seen[key] = true
		want := []string{"--kube-api-qps=7", "--" + strings.ToLower(sidecar) + "-extra"}
		if n := len(c.args); n < 2 || !slices.Equal(c.args[n-2:], want) {
			t.Errorf("%s: args %q do not end with sidecars.%s.extraArgs %q", key, c.args, sidecar, want)
		}
	}
	for _, list := range sidecarValues {
		for _, key := range list {
			if !seen[key] {
				t.Errorf("%s: not rendered", key)
			}
		}
	}
	// Empty by default: the sidecars' args are the chart's own.
	for _, c := range containers(t, render(t)) {
		for _, a := range c.args {
			if strings.HasSuffix(a, "-extra") {
				t.Errorf("%s/%s: default args %q", c.workload, c.name, c.args)
			}
		}
	}
}

// TestNodeMetricsOnByDefault: the node plugin serves its volumes' metrics
// (which the alerts, the dashboard and mpnbdctl, through the API server's
// pod proxy, read) with default values, on node.metricsPort 9811 of the
// pod IP, declared as the port metrics the node PodMonitor scrapes and
// mpnbdctl looks for; node.metricsPort=0 turns them off.
func TestNodeMetricsOnByDefault(t *testing.T) {
	objs := render(t)
	args := argsOf(t, objs, "DaemonSet", "mpnbd-node", "node")
	if !slices.Contains(args, "--metrics-addr=[$(HTTP_ADDRESS)]:9811") {
		t.Errorf("node args %q: no --metrics-addr=[$(HTTP_ADDRESS)]:9811 by default", args)
	}
	if n, ok := containerPort(t, objs, "DaemonSet", "mpnbd-node", "node", "metrics"); !ok || n != 9811 {
		t.Errorf("node container: port metrics %d (declared: %v), want 9811", n, ok)
	}
	// The node PodMonitor needs nothing more.
	if _, err := tryTemplate(t, "--set", "monitoring.podMonitors.node.enabled=true"); err != nil {
		t.Errorf("monitoring.podMonitors.node.enabled=true with default values: %v", err)
	}
	objs = render(t, "--set", "node.metricsPort=0")
	for _, a := range argsOf(t, objs, "DaemonSet", "mpnbd-node", "node") {
		if strings.HasPrefix(a, "--metrics-addr") {
			t.Errorf("node.metricsPort=0: node arg %q", a)
		}
	}
	if _, ok := containerPort(t, objs, "DaemonSet", "mpnbd-node", "node", "metrics"); ok {
		t.Error("node.metricsPort=0: the node container still declares the port metrics")
	}
}

// TestStorageAgentTolerations: storageAgent.tolerations reach the storage
// agent's pods (storage nodes tainted for storage alone), and none are
// set by default: the agent runs only where storageAgent.nodeSelector
// and the nodes' taints let it.
func TestStorageAgentTolerations(t *testing.T) {
	tolerations := func(objs []*unstructured.Unstructured) string {
		v, _ := podSpecField(t, find(t, objs, "DaemonSet", "mpnbd-storage-agent"), "tolerations")
		return fmt.Sprint(v)
	}
	if got := tolerations(render(t)); got != "<nil>" {
		t.Errorf("default storage agent tolerations %s, want none", got)
	}
	if got, want := tolerations(parseObjects(t, customTemplate(t))), "[map[key:storage operator:Exists]]"; got != want {
		t.Errorf("values-custom.yaml: storage agent tolerations %s, want %s", got, want)
	}
	objs := render(t, "--set-json", `storageAgent.tolerations=[{"key":"dedicated","operator":"Equal","value":"storage","effect":"NoSchedule"}]`)
	if got, want := tolerations(objs), "[map[effect:NoSchedule key:dedicated operator:Equal value:storage]]"; got != want {
		t.Errorf("storage agent tolerations %s, want %s", got, want)
	}
}

// TestNBDPortOnStorageAddresses: the storage agent gets the NBD port alone
// (--listen=:PORT; in cluster mode it binds that port on its
// --storage-address addresses and its signal NICs' addresses, never on
// every address of the node, and refuses a host here), and by default the
// storage address is the node's InternalIP (status.hostIP), declared as
// the container port nbd.
func TestNBDPortOnStorageAddresses(t *testing.T) {
	for _, tc := range []struct {
		name  string
		objs  []*unstructured.Unstructured
		port  int64
		addrs []string // the --storage-address args
		from  string   // STORAGE_ADDRESS's field
	}{
		{"defaults", render(t), 10809, []string{"--storage-address=$(STORAGE_ADDRESS)"}, "status.hostIP"},
		{"deploy/", parseObjects(t, kustomizeDeploy(t)), 10809, []string{"--storage-address=$(STORAGE_ADDRESS)"}, "status.hostIP"},
		{"values-custom", parseObjects(t, customTemplate(t)), 10900, []string{"--storage-address=10.10.1.1,10.10.2.1,10.10.3.0/24"}, ""},
		{"both", render(t, "--set", "storageAgent.storageAddresses={10.0.0.5}"), 10809,
			[]string{"--storage-address=$(STORAGE_ADDRESS)", "--storage-address=10.0.0.5"}, "status.hostIP"},
	} {
		var agent *container
		for _, c := range containers(t, tc.objs) {
			if c.workload == "DaemonSet/mpnbd-storage-agent" && c.name == "storage-agent" {
				agent = &c
			}
		}
		if agent == nil {
			t.Fatalf("%s: no storage agent container", tc.name)
		}
		var listen, addrs []string
		for _, a := range agent.args {
			switch {
			case strings.HasPrefix(a, "--listen"):
				listen = append(listen, a)
			case strings.HasPrefix(a, "--storage-address"):
				addrs = append(addrs, a)
			}
		}
		if want := fmt.Sprintf("--listen=:%d", tc.port); !slices.Equal(listen, []string{want}) {
			t.Errorf("%s: storage agent listen args %q, want %s alone (the port, bound on the storage addresses)", tc.name, listen, want)
		}
		if !slices.Equal(addrs, tc.addrs) {
			t.Errorf("%s: storage agent --storage-address args %q, want %q", tc.name, addrs, tc.addrs)
		}
		if field, ok := envFieldPath(*agent, "STORAGE_ADDRESS"); field != tc.from || ok != (tc.from != "") {
			t.Errorf("%s: STORAGE_ADDRESS from %q (set: %v), want %q", tc.name, field, ok, tc.from)
		}
		if got, ok := containerPort(t, tc.objs, "DaemonSet", "mpnbd-storage-agent", "storage-agent", "nbd"); !ok || got != tc.port {
			t.Errorf("%s: container port nbd %d (declared: %v), want %d", tc.name, got, ok, tc.port)
		}
	}
}
