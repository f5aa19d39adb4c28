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
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"
)

// httpGet returns the status and body of GET http://host:port/path.
func httpGet(host string, port int, path string) (int, string, error) {
	c := &http.Client{Timeout: 10 * time.Second}
	resp, err := c.Get("http://" + net.JoinHostPort(host, strconv.Itoa(port)) + path)
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b), err
}

// csiCallsOK returns how many calls of method (a full gRPC method name)
// the sidecar metrics in body count as succeeded (csi-lib-utils'
// csi_sidecar_operations_seconds histogram).
func csiCallsOK(body, method string) int {
	n := 0
	for _, l := range strings.Split(body, "\n") {
		rest, ok := strings.CutPrefix(l, "csi_sidecar_operations_seconds_count{")
		if !ok {
			continue
		}
		labels, value, ok := strings.Cut(rest, "} ")
		if !ok || !strings.Contains(labels, `method_name="`+method+`"`) || !strings.Contains(labels, `grpc_status_code="OK"`) {
			continue
		}
		v, _ := strconv.ParseFloat(value, 64)
		n += int(v)
	}
	return n
}

// containerPort is the containerPort of a container of a workload
// (kind/name) in the driver's namespace, as deployed.
func (s *suite) containerPort(workload, container string) int {
	s.t.Helper()
	v := s.jsonpath(fmt.Sprintf(`{.spec.template.spec.containers[?(@.name=="%s")].ports[0].containerPort}`, container),
		"get", workload, "-n", namespace)
	n, err := strconv.Atoi(v)
	if err != nil {
		s.t.Fatalf("%s container %s: containerPort %q", workload, container, v)
	}
	return n
}

// sidecarEndpointsScenario: from the host, as a scraper would, the real
// provisioner, attacher, resizer and snapshotter serve /metrics, counting
// the CSI calls the scenarios before made (CreateVolume,
// ControllerPublishVolume, ControllerExpandVolume, CreateSnapshot), and /healthz/leader-election, on the ports the
// chart declares (the suite runs the controller on the host network); the
// registrar's and the livenessprobes' /healthz answer too.
func (s *suite) sidecarEndpointsScenario() {
	s.step("sidecars' metrics and health endpoints", func() {
		ctl := s.jsonpath("{.items[0].status.podIP}", "get", "pods", "-n", namespace, "-l", "app.kubernetes.io/component=controller")
		if ctl == "" {
			s.t.Fatal("the controller pod has no IP")
		}
		for _, sc := range []struct{ container, method string }{
			{"csi-provisioner", "/csi.v1.Controller/CreateVolume"},
			{"csi-attacher", "/csi.v1.Controller/ControllerPublishVolume"},
			{"csi-resizer", "/csi.v1.Controller/ControllerExpandVolume"},
			{"csi-snapshotter", "/csi.v1.Controller/CreateSnapshot"},
		} {
			port := s.containerPort("deploy/mpnbd-controller", sc.container)
			code, body, err := httpGet(ctl, port, "/metrics")
			if err != nil || code != http.StatusOK {
				s.t.Fatalf("%s /metrics on %s:%d: %d %v", sc.container, ctl, port, code, err)
			}
			n := csiCallsOK(body, sc.method)
			if n == 0 {
				s.t.Errorf("%s /metrics counts no successful %s:\n%s", sc.container, sc.method, body)
			}
			code, body, err = httpGet(ctl, port, "/healthz/leader-election")
			if err != nil || code != http.StatusOK {
				s.t.Errorf("%s /healthz/leader-election on %s:%d: %d %q %v", sc.container, ctl, port, code, body, err)
			}
			s.t.Logf("%s on %s:%d: /metrics counts %d successful %s; /healthz/leader-election %d", sc.container, ctl, port, n, sc.method, code)
		}
		for _, hc := range []struct {
			host              string
			workload, ctr     string
			portCtr, portName string
		}{
			{ctl, "deploy/mpnbd-controller", "liveness-probe", "controller", "healthz"},
			{s.nodeHTTPHost(), "ds/mpnbd-node", "liveness-probe", "node", "healthz"},
			{s.nodeHTTPHost(), "ds/mpnbd-node", "node-driver-registrar", "node-driver-registrar", "registrar"},
		} {
			port := s.containerPort(hc.workload, hc.portCtr)
			code, body, err := httpGet(hc.host, port, "/healthz")
			if err != nil || code != http.StatusOK {
				s.t.Errorf("%s %s /healthz on %s:%d (port %s): %d %q %v", hc.workload, hc.ctr, hc.host, port, hc.portName, code, body, err)
			}
		}
		// The sidecars at their new versions must need no more RBAC than
		// the chart grants: say so if they were refused anything.
		for _, c := range []string{"csi-provisioner", "csi-attacher", "csi-resizer", "csi-snapshotter"} {
			logs := s.kubectl("logs", "-n", namespace, "deploy/mpnbd-controller", "-c", c, "--tail=-1")
			for _, l := range strings.Split(logs, "\n") {
				if strings.Contains(l, "forbidden") {
					s.t.Logf("WARNING: %s was refused: %s", c, l)
				}
			}
		}
	})
}

func TestCSICallsOK(t *testing.T) {
	body := `# TYPE csi_sidecar_operations_seconds histogram
csi_sidecar_operations_seconds_bucket{driver_name="d",grpc_status_code="OK",method_name="/csi.v1.Controller/CreateVolume",le="0.1"} 1
csi_sidecar_operations_seconds_bucket{driver_name="d",grpc_status_code="OK",method_name="/csi.v1.Controller/CreateVolume",le="+Inf"} 2
csi_sidecar_operations_seconds_sum{driver_name="d",grpc_status_code="OK",method_name="/csi.v1.Controller/CreateVolume"} 0.5
csi_sidecar_operations_seconds_count{driver_name="d",grpc_status_code="OK",method_name="/csi.v1.Controller/CreateVolume"} 2
csi_sidecar_operations_seconds_count{driver_name="d",grpc_status_code="DeadlineExceeded",method_name="/csi.v1.Controller/CreateVolume"} 3
csi_sidecar_operations_seconds_count{driver_name="d",grpc_status_code="OK",method_name="/csi.v1.Controller/DeleteVolume"} 4
`
	if n := csiCallsOK(body, "/csi.v1.Controller/CreateVolume"); n != 2 {
		t.Errorf("CreateVolume: %d, want 2", n)
	}
	if n := csiCallsOK(body, "/csi.v1.Controller/ControllerExpandVolume"); n != 0 {
		t.Errorf("ControllerExpandVolume: %d, want 0", n)
	}
}
