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
	"archive/tar"
	"bytes"
	"compress/gzip"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/mpnbd/mpnbd/internal/testenv/repo"
)

// cliReport is the part of mpnbdctl's --output json the suite checks.
type cliReport struct {
	Volumes []struct {
		Name         string `json:"name"`
		PVC          string `json:"pvc"`
		StorageNode  string `json:"storageNode"`
		Health       string `json:"health"`
		Publications []struct {
			Node     string `json:"node"`
			Metrics  string `json:"metrics"`
			Health   string `json:"health"`
			DataPath *struct {
				Transport        string `json:"transport"`
				Connected        bool   `json:"connected"`
				MPTCP            bool   `json:"mptcp"`
				ExpectedSubflows *int   `json:"expectedSubflows"`
				Connections      []struct {
					Subflows int `json:"subflows"`
					Paths    []struct {
						Local         string  `json:"local"`
						Remote        string  `json:"remote"`
						SentBytes     uint64  `json:"sentBytes"`
						ReceivedBytes uint64  `json:"receivedBytes"`
						RTTSeconds    float64 `json:"rttSeconds"`
					} `json:"paths"`
				} `json:"connections"`
			} `json:"dataPath"`
		} `json:"publications"`
	} `json:"volumes"`
}

// mpnbdctl runs the operator's CLI, built from this tree, as an operator
// would from outside the cluster: with the admin kubeconfig, reading the
// node plugin's metrics through the API server (its pod proxy), as it
// does by default.
func (s *suite) mpnbdctl(args ...string) (string, error) {
	bin := filepath.Join(s.dir, "mpnbdctl")
	if s.cliBuilt == "" {
		root, err := repo.Root()
		if err != nil {
			return "", err
		}
		build := exec.CommandContext(s.ctx, "go", "build", "-o", bin, "./cmd/mpnbdctl")
		build.Dir = root
		if out, err := build.CombinedOutput(); err != nil {
			return "", fmt.Errorf("go build ./cmd/mpnbdctl: %v\n%s", err, out)
		}
		s.cliBuilt = bin
	}
	cmd := exec.CommandContext(s.ctx, bin, append([]string{"--kubeconfig", s.c.Kubeconfig}, args...)...)
	out, err := cmd.CombinedOutput()
	return string(out), err
}

// checkCLI: mpnbdctl shows the claim's volume on its storage node,
// published to this node, healthy, on the fuse transport with one
// connection of one subflow per path, which together sent at least
// minSent bytes; its table names the volume too.
func (s *suite) checkCLI(claim, id string, minSent uint64) {
	s.waitFor("mpnbdctl shows the volume healthy", time.Minute, func() string {
		out, err := s.mpnbdctl("-o", "json", "volume", "default/"+claim)
		if err != nil {
			return fmt.Sprintf("mpnbdctl volume default/%s: %v\n%s", claim, err, out)
		}
		var rep cliReport
		if err := json.Unmarshal([]byte(out), &rep); err != nil {
			return fmt.Sprintf("mpnbdctl -o json: %v\n%s", err, out)
		}
		if len(rep.Volumes) != 1 {
			return fmt.Sprintf("%d volumes, want 1:\n%s", len(rep.Volumes), out)
		}
		v := rep.Volumes[0]
		if v.Name != id || v.PVC != "default/"+claim || v.StorageNode != s.c.NodeName || v.Health != "Healthy" || len(v.Publications) != 1 {
			return "volume:\n" + out
		}
		p := v.Publications[0]
		dp := p.DataPath
		if p.Node != s.c.NodeName || dp == nil || dp.Transport != "fuse" || !dp.Connected || !dp.MPTCP ||
			dp.ExpectedSubflows == nil || *dp.ExpectedSubflows != paths || len(dp.Connections) != 1 || dp.Connections[0].Subflows != paths {
			return "publication:\n" + out
		}
		// Bytes per path: one per storage address, and at least what
		// the pod wrote sent over them together.
		c := dp.Connections[0]
		remotes := map[string]bool{}
		var sent uint64
		for _, p := range c.Paths {
			remotes[p.Remote] = true
			sent += p.SentBytes
			// The kernel's round-trip time of each path (a veth pair
			// shaped by tbf: under a second).
			if p.RTTSeconds <= 0 || p.RTTSeconds >= 1 {
				return fmt.Sprintf("path %s -> %s: round-trip time %vs:\n%s", p.Local, p.Remote, p.RTTSeconds, out)
			}
		}
		if len(remotes) != paths || sent < minSent {
			return fmt.Sprintf("paths to %d storage addresses (want %d), %d bytes sent (want >= %d):\n%s", len(remotes), paths, sent, minSent, out)
		}
		return ""
	})
	if out, err := s.mpnbdctl("volume", "default/"+claim); err != nil {
		s.t.Errorf("mpnbdctl volume default/%s: %v\n%s", claim, err, out)
	} else {
		s.t.Logf("mpnbdctl volume default/%s:\n%s", claim, out)
	}
	out, err := s.mpnbdctl("volumes")
	if err != nil || !strings.Contains(out, id) || !strings.Contains(out, "fuse") {
		s.t.Errorf("mpnbdctl volumes: %v\n%s", err, out)
	}
	s.checkSupportBundle(id)
}

// checkSupportBundle: mpnbdctl support-bundle, with the volume id
// published, writes an archive holding the volume's NBDVolume, a node
// plugin's log and its metrics (read through the API server: the
// kubelet's logs, the pod proxy) and no Secret, by name or by value.
// What it could not collect is logged, not a failure.
func (s *suite) checkSupportBundle(id string) {
	t := s.t
	file := filepath.Join(s.dir, "support-bundle.tar.gz")
	out, err := s.mpnbdctl("support-bundle", "-n", namespace, "-o", file)
	if err != nil {
		t.Errorf("mpnbdctl support-bundle: %v\n%s", err, out)
		return
	}
	f, err := os.Open(file)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	gz, err := gzip.NewReader(f)
	if err != nil {
		t.Fatalf("support bundle: %v", err)
	}
	raw, err := io.ReadAll(gz)
	if err != nil {
		t.Fatalf("support bundle: %v", err)
	}
	files := map[string]string{}
	for tr := tar.NewReader(bytes.NewReader(raw)); ; {
		h, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatalf("support bundle: %v", err)
		}
		b, err := io.ReadAll(tr)
		if err != nil {
			t.Fatalf("support bundle %s: %v", h.Name, err)
		}
		_, name, _ := strings.Cut(h.Name, "/")
		files[name] = string(b)
	}
	t.Logf("mpnbdctl support-bundle: %s%s", out, files["summary.txt"])
	var logs, metrics int
	for _, p := range strings.Fields(s.jsonpath("{.items[*].metadata.name}", "get", "pods", "-n", namespace, "-l", "app.kubernetes.io/component=node")) {
		if len(files["logs/"+namespace+"/"+p+"/node.log"]) > 0 {
			logs++
		}
		if strings.Contains(files["metrics/"+namespace+"/"+p+".txt"], `mpnbd_node_volume_connected{`) {
			metrics++
		}
	}
	if logs == 0 || metrics == 0 {
		t.Errorf("support bundle: %d node plugin logs, %d node plugin metrics; want one of each at least", logs, metrics)
	}
	if !strings.Contains(files["mpnbd/nbdvolumes.yaml"], "name: "+id+"\n") {
		t.Errorf("support bundle: no NBDVolume %s in mpnbd/nbdvolumes.yaml", id)
	}
	for name := range files {
		if strings.Contains(name, "secret") {
			t.Errorf("support bundle: holds %s", name)
		}
	}
	s.noSecretValueIn(string(raw), "the support bundle")
}

// buildInfoScenario: the node plugin, the controller and the storage
// agent each say on /metrics that they run the image just built
// (mpnbd_build_info's version is the one the image was built with), the
// controller its view of the storage node and its API requests, the agent
// its controller-runtime work queues; the node plugin and the agent the
// validity of their certificates.
func (s *suite) buildInfoScenario(version string) {
	s.step("every component's mpnbd_build_info names the image's version", func() {
		agentIP := s.jsonpath("{.items[0].status.podIP}", "get", "pods", "-n", namespace, "-l", "app.kubernetes.io/component=storage-agent")
		for _, tc := range []struct {
			component, url string
			also           []string
		}{
			{"node", s.nodeMetricsURL(), []string{`mpnbd_certificate_not_after_timestamp_seconds{kind="node"}`}},
			{"controller", "http://" + net.JoinHostPort(s.nodeHTTPHost(), strconv.Itoa(controllerMetricsPort)) + "/metrics",
				[]string{`mpnbd_controller_storage_node_ready{storage_node="` + s.c.NodeName + `"} 1`, "rest_client_requests_total{", `mpnbd_csi_requests_total{code="OK",method="`}},
			{"storage-agent", "http://" + net.JoinHostPort(agentIP, strconv.Itoa(agentMetricsPort)) + "/metrics",
				[]string{"workqueue_adds_total{", "rest_client_requests_total{", `mpnbd_certificate_not_after_timestamp_seconds{kind="storage"}`}},
		} {
			want := append([]string{`mpnbd_build_info{component="` + tc.component + `",`, `version="` + version + `"} 1`}, tc.also...)
			s.waitFor(tc.component+"'s metrics", time.Minute, func() string {
				out, err := scrape(tc.url)
				if err != nil {
					return err.Error()
				}
				for _, w := range want {
					if !strings.Contains(out, w) {
						return fmt.Sprintf("%s has no %s", tc.url, w)
					}
				}
				return ""
			})
		}
		// The operator's CLI: the workloads run one image (the one the
		// upgrade brought), and the storage node is Ready.
		out, err := s.mpnbdctl("version", "-o", "json")
		var v struct {
			Agree  bool     `json:"agree"`
			Images []string `json:"images"`
		}
		if err != nil || json.Unmarshal([]byte(out), &v) != nil || !v.Agree || len(v.Images) != 1 || v.Images[0] != strings.Split(driverImage, ":")[0]+":"+upgradedImageTag {
			s.t.Errorf("mpnbdctl version: %v, %+v\n%s", err, v, out)
		}
		out, err = s.mpnbdctl("storage-nodes")
		if err != nil || !strings.Contains(out, s.c.NodeName) || !strings.Contains(out, "True") {
			s.t.Errorf("mpnbdctl storage-nodes: %v\n%s", err, out)
		}
	})
}

// scrape reads a /metrics page.
func scrape(url string) (string, error) {
	c := &http.Client{Timeout: 10 * time.Second}
	resp, err := c.Get(url)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err == nil && resp.StatusCode != http.StatusOK {
		err = fmt.Errorf("%s: %s", url, resp.Status)
	}
	return string(b), err
}
