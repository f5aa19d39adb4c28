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
	"regexp"
	"strconv"
	"time"
)

// storageLossScenario: fio --verify=crc32c from node-c on an unreplicated
// volume while the storage node holding it dies (packets dropped, every
// process SIGKILLed). The volume waits, as a hard mount does: the pod
// keeps running with its I/O held, and an operator sees what the runbook
// (docs/operations.md) names: the NBDStorageNode not Ready with a
// StorageNodeNotReady Event, the NBDVolume not Reachable, and on the
// client node the metric MpnbdVolumeInaccessible fires on
// (mpnbd_node_volume_inaccessible 1). The node is powered on again: the
// storage node Ready (a StorageNodeReady Event), the volume Reachable,
// the metric back to 0, and fio goes on to verify every round: 0 errors,
// the longest I/O (the outage) printed.
func (s *suite) storageLossScenario() {
	t := s.t
	s.apply(pvc("sloss", "mpnbd-block", "256Mi", true))
	s.startPod("sloss-fio", onNode(fioPod("sloss-fio", "sloss", 15*time.Minute), "node-c"))
	id := s.jsonpath("{.spec.volumeName}", "get", "pvc", "sloss")
	holder := s.jsonpath("{.spec.storageNode}", "get", "nbdvolume", id)
	dead := s.node(holder)
	client := s.node("node-c")
	inaccessible := func() string {
		v, err := nodeVolumeMetric(client, "mpnbd_node_volume_inaccessible", id)
		if err != nil {
			return err.Error()
		}
		return v
	}
	// sees waits (bounded) for what an operator sees: the storage node's
	// Ready and the volume's Reachable condition status, node-c's gauge
	// of the volume inaccessible, and one Event of reason on the storage
	// node since there were before of them.
	sees := func(what string, timeout time.Duration, status, gauge, reason string, before int) {
		s.waitFor(what, timeout, func() string {
			ready := s.jsonpath(`{.status.conditions[?(@.type=="Ready")].status}`, "get", "nbdnode", holder)
			reach := s.jsonpath(`{.status.conditions[?(@.type=="Reachable")].status}`, "get", "nbdvolume", id)
			if g := inaccessible(); ready != status || reach != status || g != gauge {
				return fmt.Sprintf("storage node Ready %q, volume Reachable %q, mpnbd_node_volume_inaccessible %s", ready, reach, g)
			}
			if n := s.storageNodeEvents(holder, reason) - before; n != 1 {
				return fmt.Sprintf("%d %s Events", n, reason)
			}
			return ""
		})
	}
	notReadyBefore, readyBefore := s.storageNodeEvents(holder, "StorageNodeNotReady"), s.storageNodeEvents(holder, "StorageNodeReady")
	var lost time.Time
	s.step("storage loss: the storage node of an unreplicated volume dies under fio", func() {
		s.waitFor("fio's first verified round", 2*time.Minute, func() string {
			if out, _ := s.c.Kubectl(s.ctx, "logs", "sloss-fio"); !roundVerified.MatchString(out) {
				return "log: " + lastLines([]byte(out), 3)
			}
			return ""
		})
		lost = time.Now()
		if err := dead.Kill(); err != nil {
			t.Fatal(err)
		}
		sees("the storage node not Ready, the volume not Reachable and inaccessible on node-c", 2*time.Minute, "False", "1", "StorageNodeNotReady", notReadyBefore)
		t.Logf("storage loss: %s down; %v later:\n%s\n%s", holder, time.Since(lost).Round(time.Second),
			s.kubectl("get", "nbdnode", holder, "-o", "wide"), s.kubectl("get", "nbdvol", id, "-o", "wide"))
		// Down a while longer: the I/O waits, it does not fail.
		time.Sleep(20 * time.Second)
		if p := s.jsonpath("{.status.phase}", "get", "pod", "sloss-fio"); p != "Running" {
			t.Fatalf("the fio pod is %s while the storage node is down, want Running (its I/O waiting): %s", p, s.kubectl("logs", "sloss-fio"))
		}
	})
	s.step("storage loss: the node back, the volume Reachable, fio verifies on", func() {
		back := time.Now()
		if err := dead.Revive(s.ctx); err != nil {
			t.Fatal(err)
		}
		sees("the storage node Ready, the volume Reachable and accessible on node-c", 4*time.Minute, "True", "0", "StorageNodeReady", readyBefore)
		t.Logf("storage loss: %s back; the volume Reachable %v after its return", holder, time.Since(back).Round(time.Second))
		out := s.stopFio("sloss-fio", 2)
		rounds := s.fioRounds("sloss-fio", out)
		t.Logf("storage loss: fio --verify across %v of the storage node down: %s verified rounds, 0 errors, longest I/O %v",
			back.Sub(lost).Round(time.Second), rounds, longestIO(out))
		s.kubectl("delete", "pod", "sloss-fio", "--wait=true", "--timeout=120s")
		s.kubectl("delete", "pvc", "sloss", "--wait=true", "--timeout=120s")
	})
}

// node is the cluster's node name.
func (s *suite) node(name string) *Node {
	s.t.Helper()
	for _, n := range s.c.Nodes {
		if n.Name == name {
			return n
		}
	}
	s.t.Fatalf("no node %q in the cluster", name)
	return nil
}

// nodeVolumeMetric is the value of a node plugin's per-volume gauge for
// volume id, scraped from n's node plugin (the chart's metrics port, on
// the node's address).
func nodeVolumeMetric(n *Node, name, id string) (string, error) {
	c := http.Client{Timeout: 5 * time.Second}
	resp, err := c.Get("http://" + net.JoinHostPort(n.IP, strconv.Itoa(chartNodeMetricsPort)) + "/metrics")
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return "", err
	}
	m := regexp.MustCompile(`(?m)^` + regexp.QuoteMeta(name) + `\{[^}]*volume="` + regexp.QuoteMeta(id) + `"[^}]*\} (\S+)$`).FindSubmatch(b)
	if m == nil {
		return "", fmt.Errorf("%s has no %s for volume %s", n.Name, name, id)
	}
	return string(m[1]), nil
}

// chartNodeMetricsPort is the node plugin's metrics port in the chart's
// values (node.metricsPort).
const chartNodeMetricsPort = 9811
