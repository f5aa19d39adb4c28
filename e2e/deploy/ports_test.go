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
// --flag=[host]:port.
var listenArg = regexp.MustCompile(`^--[a-z0-9-]+=(\[[0-9a-fA-F:]*\]|[0-9A-Za-z.-]*):([0-9]{1,5})$`)

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
		"all on the host": render(t, "--set", "controller.hostNetwork=true", "--set", "node.metricsPort=9811"),
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
