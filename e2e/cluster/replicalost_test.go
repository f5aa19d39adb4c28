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
	"slices"
	"strings"
	"time"
)

// replicaLostScenario: fio --verify=crc32c from node-d on a volume of two
// replicas (node-a and node-b) while the storage node holding its primary
// is stopped for good, as docs/operations.md's runbook has it: the node
// dies (packets dropped, every process SIGKILLed), the volume fails over
// to the other replica, and once the dead node's agent is not reporting
// the operator says it will not come back (mpnbdctl forget). Meanwhile
// two more storage nodes joined (node-c and node-d labelled): the lost
// replica is replaced on one of them (X), copied whole while fio goes
// on, and counted in sync; then X is drained (mpnbdctl drain): its
// replica copied to the other new node and X released. fio sees no I/O
// error and no verify failure through all of it. The dead node is booted
// again at the end: its agent, forgotten, makes its NBDStorageNode anew.
func (s *suite) replicaLostScenario() {
	t := s.t
	replicas := func(id string) []string {
		r := strings.Fields(s.jsonpath("{.spec.replicaNodes[*]}", "get", "nbdvolume", id))
		slices.Sort(r)
		return r
	}
	var id, primary string
	s.step("lost: two replicas in sync under fio; two more storage nodes join", func() {
		id, primary = s.replicatedUnderFio("lost", "lost-fio")
		s.kubectl("label", "node", "node-c", "node-d", "mpnbd.io/storage-node=true")
		s.waitDriverReady([]string{"node-c", "node-d"}, nil)
	})
	dead := s.node(primary)
	var x string
	s.step("lost: the primary's storage node stopped for good, forgotten, its replica replaced", func() {
		failedOver := s.killPrimary(id, dead)
		s.waitFor(primary+"'s agent not reporting", time.Minute, func() string {
			ready := s.jsonpath(`{.status.conditions[?(@.type=="Ready")].status}`, "get", "nbdnode", primary)
			reason := s.jsonpath(`{.status.conditions[?(@.type=="Ready")].reason}`, "get", "nbdnode", primary)
			if ready != "False" || reason != "AgentNotReporting" {
				return "Ready " + ready + " " + reason
			}
			return ""
		})
		out, err := s.mpnbdctl("forget", primary)
		if err != nil {
			t.Fatalf("mpnbdctl forget %s: %v\n%s", primary, err, out)
		}
		forgotten := time.Now()
		t.Logf("lost: %s forgotten:\n%s", primary, out)
		s.waitFor("the lost replica replaced on node-c or node-d", 2*time.Minute, func() string {
			r := replicas(id)
			for _, n := range r {
				if n == "node-c" || n == "node-d" {
					x = n
					return ""
				}
			}
			return "replicas " + strings.Join(r, " ")
		})
		s.waitFor("the replacement copied in sync", 5*time.Minute, s.inSync(id, "2"))
		if r := replicas(id); slices.Contains(r, primary) {
			t.Errorf("replicas %v still name %s, forgotten", r, primary)
		}
		s.waitEvent(id, "ReplicaReplaced")
		t.Logf("lost: %s died; failed over %v later; forgotten, its replica replaced on %s and copied in sync %v after the forget",
			primary, failedOver, x, time.Since(forgotten).Round(time.Second))
	})
	s.step("lost: the replacement's node drained under fio", func() {
		y := map[string]string{"node-c": "node-d", "node-d": "node-c"}[x]
		began := time.Now()
		out, err := s.mpnbdctl("drain", x, "--wait", "5m")
		if err != nil {
			t.Fatalf("mpnbdctl drain %s: %v\n%s\n%s", x, err, out, s.kubectl("get", "nbdvol", "-o", "wide"))
		}
		if r := replicas(id); slices.Contains(r, x) || !slices.Contains(r, y) {
			t.Errorf("replicas %v after the drain of %s, want %s among them and not %s", r, x, y, x)
		}
		s.waitFor("two in sync after the drain", 5*time.Minute, s.inSync(id, "2"))
		t.Logf("lost: %s drained in %v, the replica now on %s (replicas %v)", x, time.Since(began).Round(time.Second), y, replicas(id))
		fio := s.stopFio("lost-fio", 2)
		t.Logf("lost: fio --verify across the loss of %s for good, the replacement and its drain: %s verified rounds, 0 errors, longest I/O %v",
			primary, s.fioRounds("lost-fio", fio), longestIO(fio))
		if out, err := s.mpnbdctl("uncordon", x); err != nil {
			t.Errorf("mpnbdctl uncordon %s: %v\n%s", x, err, out)
		}
		s.kubectl("delete", "pod", "lost-fio", "--wait=true", "--timeout=120s")
		s.kubectl("delete", "pvc", "lost", "--wait=true", "--timeout=120s")
	})
	s.step("lost: the forgotten node boots again, a storage node holding nothing", func() {
		if err := dead.Revive(s.ctx); err != nil {
			t.Fatal(err)
		}
		s.waitDriverReady([]string{primary}, nil)
	})
}
