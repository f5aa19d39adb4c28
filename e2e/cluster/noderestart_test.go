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
	"strings"
	"time"
)

// restartsScenario: the driver's pods restarted on one node while the
// others run, under fio --verify on two nodes (node-c and node-d, each
// on a volume of its own): node-c's node plugin pod deleted (the other
// nodes' plugins untouched; node-c's volume goes on, its data path lives
// in the datapath pod); the storage agent of node-c's volume deleted (the
// volumes' sessions ride it out: redial, replay); then the datapath
// DaemonSet rolled node by node, each new pod taking its node's volumes
// over from the old one (a handover). Neither fio sees an I/O error or a
// verify failure, and each volume is healthy on its node afterwards.
func (s *suite) restartsScenario() {
	t := s.t
	workers := []string{"node-c", "node-d"}
	ids := map[string]string{}
	for _, n := range workers {
		claim, p := "rs-"+n, "rs-fio-"+n
		s.apply(pvc(claim, "mpnbd-block", "256Mi", true))
		s.startPod(p, onNode(fioPod(p, claim, 15*time.Minute), n))
		ids[n] = s.jsonpath("{.spec.volumeName}", "get", "pvc", claim)
	}
	for _, n := range workers {
		s.waitFor("fio's first verified round on "+n, 2*time.Minute, func() string {
			if out, _ := s.c.Kubectl(s.ctx, "logs", "rs-fio-"+n); !roundVerified.MatchString(out) {
				return "log: " + lastLines([]byte(out), 3)
			}
			return ""
		})
	}
	// podOn is the name of the driver's component pod on node ("" for
	// none).
	podOn := func(component, node string) string {
		return s.jsonpath("{.items[0].metadata.name}", "get", "pods", "-n", namespace, "-l", "app.kubernetes.io/component="+component,
			"--field-selector", "spec.nodeName="+node)
	}
	// replaced deletes component's pod on node and waits for its
	// successor to run; the component's pods on the other nodes must be
	// the ones they were.
	replaced := func(component, node string) {
		others := map[string]string{}
		for _, n := range s.c.Nodes {
			if n.Name != node {
				others[n.Name] = podOn(component, n.Name)
			}
		}
		old := podOn(component, node)
		if old == "" {
			t.Fatalf("no %s pod on %s", component, node)
		}
		s.kubectl("delete", "pod", "-n", namespace, old, "--wait=true", "--timeout=2m")
		s.waitFor("a new "+component+" pod running on "+node, 3*time.Minute, func() string {
			p := podOn(component, node)
			if p == "" || p == old {
				return "pod " + p
			}
			if ph := s.jsonpath("{.status.phase}", "get", "pod", "-n", namespace, p); ph != "Running" {
				return p + " " + ph
			}
			return ""
		})
		for n, p := range others {
			if now := podOn(component, n); now != p {
				t.Errorf("the %s pod on %s changed from %q to %q while %s's was replaced", component, n, p, now, node)
			}
		}
	}
	s.step("restarts: node-c's node plugin pod deleted under fio on node-c and node-d", func() {
		replaced("node", "node-c")
	})
	holder := s.jsonpath("{.spec.storageNode}", "get", "nbdvolume", ids["node-c"])
	s.step("restarts: the storage agent of node-c's volume deleted", func() {
		replaced("storage-agent", holder)
		s.waitFor(holder+" Ready", 2*time.Minute, func() string {
			if r := s.jsonpath(`{.status.conditions[?(@.type=="Ready")].status}`, "get", "nbdnode", holder); r != "True" {
				return "Ready " + r
			}
			return ""
		})
	})
	s.step("restarts: the datapath rolled node by node, each volume taken over", func() {
		old := map[string]string{}
		for _, n := range workers {
			old[n] = podOn("datapath", n)
		}
		s.kubectl("rollout", "restart", "daemonset/mpnbd-datapath", "-n", namespace)
		s.kubectl("rollout", "status", "daemonset/mpnbd-datapath", "-n", namespace, "--timeout=5m")
		for _, n := range workers {
			// A surge: the old pod goes once the new one took over.
			var p string
			s.waitFor("the old datapath pod on "+n+" to go", 2*time.Minute, func() string {
				names := strings.Fields(s.jsonpath("{.items[*].metadata.name}", "get", "pods", "-n", namespace,
					"-l", "app.kubernetes.io/component=datapath", "--field-selector", "spec.nodeName="+n))
				if len(names) != 1 || names[0] == old[n] {
					return fmt.Sprintf("datapath pods on %s: %v (the old one %s)", n, names, old[n])
				}
				p = names[0]
				return ""
			})
			if logs := s.kubectl("logs", "-n", namespace, p, "--tail=-1"); !takenOver(logs, ids[n]) {
				t.Fatalf("the new datapath on %s did not take volume %s over from %s:\n%s", n, ids[n], old[n], lastLines([]byte(logs), 20))
			}
		}
	})
	s.step("restarts: fio finishes on both nodes, every block verified", func() {
		for _, n := range workers {
			out := s.stopFio("rs-fio-"+n, 2)
			t.Logf("restarts: fio on %s across node-c's node plugin's, the storage agent's and the datapaths' restarts: %s verified rounds, 0 errors, longest I/O %v",
				n, s.fioRounds("rs-fio-"+n, out), longestIO(out))
		}
		for _, n := range workers {
			s.kubectl("delete", "pod", "rs-fio-"+n, "--wait=true", "--timeout=120s")
			s.kubectl("delete", "pvc", "rs-"+n, "--wait=true", "--timeout=120s")
		}
	})
}
