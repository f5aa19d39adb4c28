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
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
)

// sidecarProbePaths are the CSI sidecar containers and the path the
// liveness probe on their --http-endpoint asks for: the provisioner,
// attacher, resizer and snapshotter serve /healthz/leader-election (with
// --leader-election), the registrar and the livenessprobe /healthz.
var sidecarProbePaths = map[string]string{
	"csi-provisioner":       "/healthz/leader-election",
	"csi-attacher":          "/healthz/leader-election",
	"csi-resizer":           "/healthz/leader-election",
	"csi-snapshotter":       "/healthz/leader-election",
	"node-driver-registrar": "/healthz",
	"liveness-probe":        "/healthz",
}

// pod is the pod template of one workload.
type pod struct {
	workload    string
	hostNetwork bool
	containers  []container
}

// podsOf groups the containers of objs' workloads by pod.
func podsOf(t testing.TB, objs []*unstructured.Unstructured) []pod {
	t.Helper()
	var out []pod
	for _, c := range containers(t, objs) {
		if len(out) == 0 || out[len(out)-1].workload != c.workload {
			hn, _, _ := unstructured.NestedBool(c.podSpec, "hostNetwork")
			out = append(out, pod{workload: c.workload, hostNetwork: hn})
		}
		p := &out[len(out)-1]
		p.containers = append(p.containers, c)
	}
	return out
}

// listenArg matches an argument giving an address to listen on:
// --flag=[host]:port, the host in brackets an IP address or a $(VAR) the
// kubelet expands (the chart's [$(HTTP_ADDRESS)]).
var listenArg = regexp.MustCompile(`^--[a-z0-9-]+=(\[(?:[0-9a-fA-F:.]*|\$\([A-Za-z_][A-Za-z0-9_]*\))\]|[0-9A-Za-z.-]*):([0-9]{1,5})$`)

// listeners returns the TCP ports a container's arguments make it listen
// on, each with the argument.
func listeners(c container) map[int]string {
	out := map[int]string{}
	for _, a := range c.args {
		if m := listenArg.FindStringSubmatch(a); m != nil {
			n, _ := strconv.Atoi(m[2])
			out[n] = a
		} else if v, ok := strings.CutPrefix(a, "--health-port="); ok { // the livenessprobe's older flag
			n, _ := strconv.Atoi(v)
			out[n] = a
		}
	}
	return out
}

// namedPort is one entry of a container's ports.
type namedPort struct {
	name string
	port int
}

func portsOf(c container) []namedPort {
	var out []namedPort
	list, _, _ := unstructured.NestedSlice(c.spec, "ports")
	for _, p := range list {
		pm := p.(map[string]any)
		name, _ := pm["name"].(string)
		var n int
		switch v := pm["containerPort"].(type) {
		case int64:
			n = int(v)
		case float64:
			n = int(v)
		}
		out = append(out, namedPort{name, n})
	}
	return out
}

// httpProbe returns the path and port of a container's HTTP liveness probe.
func httpProbe(c container) (path string, port any, ok bool) {
	get, ok, _ := unstructured.NestedMap(c.spec, "livenessProbe", "httpGet")
	if !ok {
		return "", nil, false
	}
	path, _ = get["path"].(string)
	return path, get["port"], true
}

// argValue returns the value of --name=VALUE among args.
func argValue(args []string, name string) (string, bool) {
	for _, a := range args {
		if v, ok := strings.CutPrefix(a, "--"+name+"="); ok {
			return v, true
		}
	}
	return "", false
}

// checkSidecarEndpoints reports each CSI sidecar without --http-endpoint,
// without a named containerPort for it or without a liveness probe on it
// (for the livenessprobe sidecar: the probe of the plugin container it
// serves), and each HTTP probe whose port its container does not declare.
// It returns how many containers of each sidecar it saw.
func checkSidecarEndpoints(pods []pod) (problems []string, seen map[string]int) {
	seen = map[string]int{}
	for _, p := range pods {
		for _, c := range p.containers {
			where := p.workload + " container " + c.name
			// Kubelet resolves a probe's named port among the container's own.
			if path, port, ok := httpProbe(c); ok {
				if name, isName := port.(string); isName && !slices.ContainsFunc(portsOf(c), func(np namedPort) bool { return np.name == name }) {
					problems = append(problems, fmt.Sprintf("%s: its probe of %s asks for port %q, which it does not declare", where, path, name))
				}
			}
			path, ok := sidecarProbePaths[c.name]
			if !ok {
				continue
			}
			seen[c.name]++
			for _, old := range []string{"health-port", "metrics-address"} {
				if _, ok := argValue(c.args, old); ok {
					problems = append(problems, fmt.Sprintf("%s: --%s (deprecated): serve on --http-endpoint", where, old))
				}
			}
			ep, ok := argValue(c.args, "http-endpoint")
			if !ok {
				problems = append(problems, where+": no --http-endpoint")
				continue
			}
			m := listenArg.FindStringSubmatch("--http-endpoint=" + ep)
			if m == nil {
				problems = append(problems, fmt.Sprintf("%s: --http-endpoint=%s is no [host]:port", where, ep))
				continue
			}
			port, _ := strconv.Atoi(m[2])
			if path == "/healthz/leader-election" && !slices.Contains(c.args, "--leader-election") {
				problems = append(problems, where+": no --leader-election, so no /healthz/leader-election")
			}
			// The containers whose probe may point at it: its own, or,
			// for the livenessprobe, the others of the pod (the plugin's).
			probers := []container{c}
			if c.name == "liveness-probe" {
				probers = nil
				for _, o := range p.containers {
					if o.name != c.name {
						probers = append(probers, o)
					}
				}
			}
			declared, probed := false, false
			for _, o := range probers {
				for _, np := range portsOf(o) {
					if np.port != port || np.name == "" {
						continue
					}
					declared = true
					if pp, pport, ok := httpProbe(o); ok && pp == path && pport == np.name {
						probed = true
					}
				}
			}
			switch {
			case !declared:
				problems = append(problems, fmt.Sprintf("%s: no named containerPort %d for its --http-endpoint", where, port))
			case !probed:
				problems = append(problems, fmt.Sprintf("%s: no liveness probe of %s on its port %d", where, path, port))
			}
		}
	}
	return problems, seen
}

// checkPortClashes reports two listeners on one port in a pod (its
// containers share a network namespace), two on one port in different
// pods on the host network (any two may share a node), and a declared
// containerPort nothing in its pod listens on.
func checkPortClashes(pods []pod) []string {
	var problems []string
	host := map[int]string{}
	for _, p := range pods {
		inPod := map[int]string{}
		for _, c := range p.containers {
			for port, arg := range listeners(c) {
				who := c.name + " " + arg
				if prev, dup := inPod[port]; dup {
					problems = append(problems, fmt.Sprintf("%s: port %d: %s and %s", p.workload, port, prev, who))
					continue
				}
				inPod[port] = who
			}
		}
		for _, c := range p.containers {
			for _, np := range portsOf(c) {
				if _, ok := inPod[np.port]; !ok {
					problems = append(problems, fmt.Sprintf("%s container %s: declares port %d (%s), on which nothing in the pod listens", p.workload, c.name, np.port, np.name))
				}
			}
		}
		if !p.hostNetwork {
			continue
		}
		for port, who := range inPod {
			who = p.workload + " " + who
			if prev, dup := host[port]; dup {
				problems = append(problems, fmt.Sprintf("host network: port %d: %s and %s", port, prev, who))
				continue
			}
			host[port] = who
		}
	}
	slices.Sort(problems)
	return problems
}

// portRenderings are the renderings the port checks run on: deploy/, the
// chart's defaults, everything on the host network (with the node
// plugin's metrics on 9811, the port the docs use) and the repository's
// values files.
func portRenderings(t *testing.T) map[string][]*unstructured.Unstructured {
	t.Helper()
	out := map[string][]*unstructured.Unstructured{
		"deploy/":         parseObjects(t, kustomizeDeploy(t)),
		"chart defaults":  parseObjects(t, helmTemplate(t)),
		"values-custom":   parseObjects(t, helmTemplate(t, "e2e/deploy/testdata/values-custom.yaml")),
		"values-cluster":  parseObjects(t, helmTemplate(t, "e2e/deploy/testdata/values-cluster.yaml")),
		"no datapath":     parseObjects(t, helmTemplate(t, "e2e/deploy/testdata/values-no-datapath.yaml")),
		"all on the host": render(t, "--set", "controller.hostNetwork=true"),
	}
	return out
}

func render(t *testing.T, args ...string) []*unstructured.Unstructured {
	t.Helper()
	b, err := tryTemplate(t, args...)
	if err != nil {
		t.Fatal(err)
	}
	return parseObjects(t, b)
}

// TestSidecarHTTPEndpoints: every CSI sidecar serves on --http-endpoint,
// a named containerPort declares it and a liveness probe asks it (the
// provisioner, attacher and resizer for /healthz/leader-election, the
// registrar for /healthz, the livenessprobe for /healthz through the
// plugin container's probe).
func TestSidecarHTTPEndpoints(t *testing.T) {
	for name, objs := range portRenderings(t) {
		problems, seen := checkSidecarEndpoints(podsOf(t, objs))
		for _, p := range problems {
			t.Errorf("%s: %s", name, p)
		}
		want := map[string]int{"csi-provisioner": 1, "csi-attacher": 1, "csi-resizer": 1, "csi-snapshotter": 1, "node-driver-registrar": 1, "liveness-probe": 2}
		if fmt.Sprint(seen) != fmt.Sprint(want) {
			t.Errorf("%s: sidecar containers %v, want %v", name, seen, want)
		}
	}
}

// TestPortsDoNotClash: no two listeners share a port in a pod, nor on
// the host network (the node plugin, datapath and, by default, storage
// agent pods always, the controller with controller.hostNetwork), and
// every declared containerPort has a listener.
func TestPortsDoNotClash(t *testing.T) {
	for name, objs := range portRenderings(t) {
		for _, p := range checkPortClashes(podsOf(t, objs)) {
			t.Errorf("%s: %s", name, p)
		}
	}
}

// TestPortChecksCanFail: the two checks above find a clash in a pod, one
// across host-network pods, a sidecar without a probe and one without
// --http-endpoint.
func TestPortChecksCanFail(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--set", "sidecars.provisioner.httpPort=9808"},
			"Deployment/mpnbd-controller: port 9808: "},
		{[]string{"--set", "controller.hostNetwork=true", "--set", "sidecars.attacher.httpPort=9815"},
			"host network: port 9815: "},
		{[]string{"--set", "sidecars.nodeDriverRegistrar.httpPort=9810"},
			"host network: port 9810: "},
	} {
		got := checkPortClashes(podsOf(t, render(t, tc.args...)))
		if !slices.ContainsFunc(got, func(p string) bool { return strings.HasPrefix(p, tc.want) }) {
			t.Errorf("%q: clashes %q, want one starting %q", tc.args, got, tc.want)
		}
	}

	objs := parseObjects(t, helmTemplate(t))
	ctl := find(t, objs, "Deployment", "mpnbd-controller")
	list, _, _ := unstructured.NestedSlice(ctl.Object, "spec", "template", "spec", "containers")
	for _, c := range list {
		cm := c.(map[string]any)
		switch cm["name"] {
		case "csi-resizer":
			delete(cm, "livenessProbe")
		case "csi-attacher":
			args := cm["args"].([]any)
			cm["args"] = slices.DeleteFunc(slices.Clone(args), func(a any) bool { return strings.HasPrefix(a.(string), "--http-endpoint=") })
		}
	}
	if err := unstructured.SetNestedSlice(ctl.Object, list, "spec", "template", "spec", "containers"); err != nil {
		t.Fatal(err)
	}
	got, _ := checkSidecarEndpoints(podsOf(t, objs))
	want := []string{
		"Deployment/mpnbd-controller container csi-attacher: no --http-endpoint",
		"Deployment/mpnbd-controller container csi-resizer: no liveness probe of /healthz/leader-election on its port 9814",
	}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("checkSidecarEndpoints = %q, want %q", got, want)
	}
	// And a declared port nobody listens on (the attacher's, above).
	if got := checkPortClashes(podsOf(t, objs)); !slices.Contains(got,
		"Deployment/mpnbd-controller container csi-attacher: declares port 9813 (attacher), on which nothing in the pod listens") {
		t.Errorf("checkPortClashes = %q", got)
	}
}

// httpFlags are the flags giving the address an HTTP endpoint listens
// on: the CSI sidecars' --http-endpoint, the node plugin's and the
// storage agent's --metrics-addr (/metrics, /healthz, /readyz).
var httpFlags = []string{"http-endpoint", "metrics-addr"}

// httpAddressEnv is the variable holding the address the chart's HTTP
// endpoints bind to (its httpAddressFrom).
const httpAddressEnv = "HTTP_ADDRESS"

// envFieldPath returns the downward API field a container's variable
// name comes from ("" for a literal value), and whether it has one.
func envFieldPath(c container, name string) (field string, ok bool) {
	env, _, _ := unstructured.NestedSlice(c.spec, "env")
	for _, e := range env {
		em, _ := e.(map[string]any)
		if n, _, _ := unstructured.NestedString(em, "name"); n != name {
			continue
		}
		field, _, _ = unstructured.NestedString(em, "valueFrom", "fieldRef", "fieldPath")
		return field, true
	}
	return "", false
}

// checkHTTPBindings reports, with from a downward API field (the chart's
// httpAddressFrom), each HTTP flag that does not bind to
// [$(HTTP_ADDRESS)]:PORT and each container with one whose own env does
// not take HTTP_ADDRESS from that field (the kubelet expands only the
// container's own variables); with from "", each HTTP flag that does not
// bind to :PORT. Either way it reports an HTTP_ADDRESS in a container that
// does not bind to it, and an HTTP probe naming a host: without one the
// kubelet asks the pod IP, the address bound. It returns how many HTTP
// flags it saw.
func checkHTTPBindings(pods []pod, from string) (problems []string, flags int) {
	want := regexp.MustCompile(`^:[0-9]{1,5}$`)
	if from != "" {
		want = regexp.MustCompile(`^\[\$\(` + httpAddressEnv + `\)\]:[0-9]{1,5}$`)
	}
	for _, p := range pods {
		for _, c := range p.containers {
			where := p.workload + " container " + c.name
			binds := false
			for _, f := range httpFlags {
				v, ok := argValue(c.args, f)
				if !ok {
					continue
				}
				flags++
				binds = binds || strings.Contains(v, "$("+httpAddressEnv+")")
				if !want.MatchString(v) {
					problems = append(problems, fmt.Sprintf("%s: --%s=%s, want it to match %s", where, f, v, want))
				}
			}
			field, defined := envFieldPath(c, httpAddressEnv)
			switch {
			case binds && !defined:
				problems = append(problems, fmt.Sprintf("%s: binds to $(%s), which its env does not define", where, httpAddressEnv))
			case binds && from != "" && field != from:
				problems = append(problems, fmt.Sprintf("%s: %s from field %q, want %q", where, httpAddressEnv, field, from))
			case defined && !binds:
				problems = append(problems, fmt.Sprintf("%s: defines %s, to which nothing of it binds", where, httpAddressEnv))
			}
			for _, probe := range []string{"livenessProbe", "readinessProbe", "startupProbe"} {
				if host, ok, _ := unstructured.NestedString(c.spec, probe, "httpGet", "host"); ok {
					problems = append(problems, fmt.Sprintf("%s: its %s asks host %q, not the pod IP its endpoint binds to", where, probe, host))
				}
			}
		}
	}
	slices.Sort(problems)
	return problems, flags
}

// TestHTTPEndpointsBindToPodIP: by default, in deploy/ and the chart,
// every HTTP endpoint of the driver's pods binds to [$(HTTP_ADDRESS)]:PORT
// and its container takes HTTP_ADDRESS from status.podIP (on the host
// network the node's InternalIP, so the storage NICs' addresses do not
// answer), and no probe names a host; with httpAddressFrom "" they bind
// to :PORT and no container has HTTP_ADDRESS.
func TestHTTPEndpointsBindToPodIP(t *testing.T) {
	for _, tc := range []struct {
		name  string
		objs  []*unstructured.Unstructured
		from  string
		flags int // 6 in the controller's pod, 2 or 3 in the node plugin's, 1 in the storage agent's
	}{
		{"deploy/", parseObjects(t, kustomizeDeploy(t)), "status.podIP", 10},
		{"chart defaults", parseObjects(t, helmTemplate(t)), "status.podIP", 10},
		{"all on the host", render(t, "--set", "controller.hostNetwork=true"), "status.podIP", 10},
		{"values-cluster", parseObjects(t, helmTemplate(t, "e2e/deploy/testdata/values-cluster.yaml")), "status.podIP", 10},
		{"no datapath", parseObjects(t, helmTemplate(t, "e2e/deploy/testdata/values-no-datapath.yaml")), "status.podIP", 10},
		{"every address", render(t, "--set", "httpAddressFrom="), "", 10},
		{"node metrics off", render(t, "--set", "node.metricsPort=0"), "status.podIP", 9},
		{"values-custom", parseObjects(t, helmTemplate(t, customValues)), "", 10},
	} {
		problems, flags := checkHTTPBindings(podsOf(t, tc.objs), tc.from)
		for _, p := range problems {
			t.Errorf("%s: %s", tc.name, p)
		}
		if flags != tc.flags {
			t.Errorf("%s: %d HTTP flags (--%s), want %d", tc.name, flags, strings.Join(httpFlags, ", --"), tc.flags)
		}
	}
}

// TestHTTPBindingCheckCanFail: the check above finds an endpoint on every
// address, one whose container lacks the variable or takes it from
// another field, a variable nothing binds to and a probe naming a host;
// and, for httpAddressFrom "", the defaults' bindings.
func TestHTTPBindingCheckCanFail(t *testing.T) {
	pods := podsOf(t, render(t, "--set", "node.metricsPort=9811"))
	ctr := func(workload, name string) *container {
		for i := range pods {
			for j := range pods[i].containers {
				if c := &pods[i].containers[j]; c.workload == workload && c.name == name {
					return c
				}
			}
		}
		t.Fatalf("no container %s in %s", name, workload)
		return nil
	}
	setEnv := func(c *container, env []any) {
		if err := unstructured.SetNestedSlice(c.spec, env, "env"); err != nil {
			t.Fatal(err)
		}
	}
	// The attacher on every address.
	att := ctr("Deployment/mpnbd-controller", "csi-attacher")
	for i, a := range att.args {
		if strings.HasPrefix(a, "--http-endpoint=") {
			att.args[i] = "--http-endpoint=:9813"
		}
	}
	// The node plugin without its HTTP_ADDRESS, the provisioner's from the
	// host's IP.
	node := ctr("DaemonSet/mpnbd-node", "node")
	env, _, _ := unstructured.NestedSlice(node.spec, "env")
	setEnv(node, slices.DeleteFunc(env, func(e any) bool { return e.(map[string]any)["name"] == httpAddressEnv }))
	prov := ctr("Deployment/mpnbd-controller", "csi-provisioner")
	env, _, _ = unstructured.NestedSlice(prov.spec, "env")
	for _, e := range env {
		if em := e.(map[string]any); em["name"] == httpAddressEnv {
			if err := unstructured.SetNestedField(em, "status.hostIP", "valueFrom", "fieldRef", "fieldPath"); err != nil {
				t.Fatal(err)
			}
		}
	}
	setEnv(prov, env)
	// HTTP_ADDRESS in the datapath, which serves no HTTP.
	setEnv(ctr("DaemonSet/mpnbd-datapath", "datapath"), []any{map[string]any{"name": httpAddressEnv,
		"valueFrom": map[string]any{"fieldRef": map[string]any{"fieldPath": "status.podIP"}}}})
	// The storage agent's readiness probe on 127.0.0.1.
	agent := ctr("DaemonSet/mpnbd-storage-agent", "storage-agent")
	if err := unstructured.SetNestedField(agent.spec, "127.0.0.1", "readinessProbe", "httpGet", "host"); err != nil {
		t.Fatal(err)
	}
	got, flags := checkHTTPBindings(pods, "status.podIP")
	want := []string{
		"DaemonSet/mpnbd-datapath container datapath: defines HTTP_ADDRESS, to which nothing of it binds",
		"DaemonSet/mpnbd-node container node: binds to $(HTTP_ADDRESS), which its env does not define",
		`DaemonSet/mpnbd-storage-agent container storage-agent: its readinessProbe asks host "127.0.0.1", not the pod IP its endpoint binds to`,
		`Deployment/mpnbd-controller container csi-attacher: --http-endpoint=:9813, want it to match ^\[\$\(HTTP_ADDRESS\)\]:[0-9]{1,5}$`,
		"Deployment/mpnbd-controller container csi-attacher: defines HTTP_ADDRESS, to which nothing of it binds",
		`Deployment/mpnbd-controller container csi-provisioner: HTTP_ADDRESS from field "status.hostIP", want "status.podIP"`,
	}
	if fmt.Sprint(got) != fmt.Sprint(want) || flags != 10 {
		t.Errorf("checkHTTPBindings = %q, %d flags\nwant %q, 10", got, flags, want)
	}

	// The defaults, checked as if httpAddressFrom were "".
	got, _ = checkHTTPBindings(podsOf(t, render(t)), "")
	if len(got) != 10 || !slices.Contains(got, "DaemonSet/mpnbd-storage-agent container storage-agent: --metrics-addr=[$(HTTP_ADDRESS)]:9810, want it to match ^:[0-9]{1,5}$") ||
		!slices.Contains(got, "DaemonSet/mpnbd-node container node: --metrics-addr=[$(HTTP_ADDRESS)]:9811, want it to match ^:[0-9]{1,5}$") {
		t.Errorf("the defaults checked for binding to every address: %q, want the 9 flags", got)
	}
}
