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
	"encoding/json"
	"fmt"
	"strconv"
	"time"
)

// spreadScenario: volumes over the two storage nodes as
// docs/storageclass.md says the controller places them (the storage node
// with the most available bytes, a cordoned one never), then one of them
// drained under fio --verify, as docs/replication.md's maintenance says:
//
//   - a first volume goes to one node (X); with X's report counting it,
//     the other (Y) has more room, but Y is cordoned (mpnbdctl cordon),
//     so the second goes to X too; Y uncordoned, the third goes to Y;
//   - a pod on node-c runs fio --verify on the first volume while X is
//     drained (mpnbdctl drain): X's two volumes are copied to Y while
//     served (the first attached), switched over, and X holds nothing;
//     fio sees no I/O error and no verify failure.
func (s *suite) spreadScenario() {
	t := s.t
	const size = 2 << 30
	s.apply(`apiVersion: storage.k8s.io/v1
kind: StorageClass
metadata: {name: mpnbd-spread}
provisioner: nbd.mptcp.mpnbd.io
volumeBindingMode: Immediate
parameters: {transport: fuse}
`)
	available := func(n string) int64 {
		v, _ := strconv.ParseInt(s.jsonpath("{.status.availableBytes}", "get", "nbdstoragenode", n), 10, 64)
		return v
	}
	// provision creates a claim and returns its volume and the storage
	// node holding it, once that node's report counts it: its available
	// bytes below the other's by more than the volumes it held before.
	held := map[string]int{}
	provision := func(claim string) (string, string) {
		s.apply(pvc(claim, "mpnbd-spread", "2Gi", true))
		var id string
		s.waitFor(claim+" bound", 2*time.Minute, func() string {
			if id = s.jsonpath("{.spec.volumeName}", "get", "pvc", claim); id == "" {
				return "phase " + s.jsonpath("{.status.phase}", "get", "pvc", claim)
			}
			return ""
		})
		holder := s.jsonpath("{.spec.storageNode}", "get", "nbdvolume", id)
		other := map[string]string{"node-a": "node-b", "node-b": "node-a"}[holder]
		if other == "" {
			t.Fatalf("%s's volume %s on storage node %q", claim, id, holder)
		}
		held[holder]++
		s.waitFor(holder+"'s report counting "+claim, time.Minute, func() string {
			// Each volume held reserves its size: the difference is the
			// count's, give or take what else the disk they share holds.
			if d := available(other) - available(holder); d < int64(held[holder]-held[other])*size-size/2 {
				return fmt.Sprintf("available %d on %s, %d on %s", available(holder), holder, available(other), other)
			}
			return ""
		})
		return id, holder
	}
	var x, y, first string
	var ids []string
	s.step("spread: placed by room, never on a cordoned node", func() {
		var id string
		first, x = provision("sp-1")
		y = map[string]string{"node-a": "node-b", "node-b": "node-a"}[x]
		ids = append(ids, first)
		if out, err := s.mpnbdctl("cordon", y); err != nil {
			t.Fatalf("mpnbdctl cordon %s: %v\n%s", y, err, out)
		}
		s.waitFor(y+" cordoned", 30*time.Second, func() string {
			if c := s.jsonpath("{.spec.unschedulable}", "get", "nbdstoragenode", y); c != "true" {
				return "spec.unschedulable " + c
			}
			return ""
		})
		id, on := provision("sp-2")
		ids = append(ids, id)
		if on != x {
			t.Fatalf("sp-2 went to %s, cordoned; want %s", on, x)
		}
		if out, err := s.mpnbdctl("uncordon", y); err != nil {
			t.Fatalf("mpnbdctl uncordon %s: %v\n%s", y, err, out)
		}
		id, on = provision("sp-3")
		ids = append(ids, id)
		if on != y {
			t.Fatalf("sp-3 went to %s; %s had more room:\n%s", on, y, s.kubectl("get", "nbdnode"))
		}
		t.Logf("spread: sp-1 and sp-2 on %s (%s cordoned meanwhile), sp-3 on %s:\n%s", x, y, y, s.kubectl("get", "nbdnode"))
	})
	s.step("spread: a storage node drained under fio --verify", func() {
		s.startPod("sp-fio", onNode(fioPod("sp-fio", "sp-1", 15*time.Minute), "node-c"))
		s.waitFor("fio's first verified round", 2*time.Minute, func() string {
			if out, _ := s.c.Kubectl(s.ctx, "logs", "sp-fio"); !roundVerified.MatchString(out) {
				return "log: " + lastLines([]byte(out), 3)
			}
			return ""
		})
		began := time.Now()
		out, err := s.mpnbdctl("drain", x, "--wait", "5m")
		if err != nil {
			t.Fatalf("mpnbdctl drain %s: %v\n%s\n%s", x, err, out, s.kubectl("get", "nbdvol", "-o", "wide"))
		}
		t.Logf("spread: %s drained in %v:\n%s", x, time.Since(began).Round(time.Second), out)
		for _, id := range ids {
			if on := s.jsonpath("{.spec.storageNode}", "get", "nbdvolume", id); on != y {
				t.Errorf("volume %s on %s after the drain of %s, want %s", id, on, x, y)
			}
		}
		out, err = s.mpnbdctl("-o", "json", "storage-nodes")
		var rep struct {
			StorageNodes []struct {
				Name                              string
				Primaries, Unreplicated, Replicas int
			} `json:"storageNodes"`
		}
		if err == nil {
			err = json.Unmarshal([]byte(out), &rep)
		}
		if err != nil {
			t.Fatalf("mpnbdctl -o json storage-nodes: %v\n%s", err, out)
		}
		for _, n := range rep.StorageNodes {
			if held := n.Primaries + n.Unreplicated + n.Replicas; n.Name == x && held != 0 {
				t.Errorf("mpnbdctl storage-nodes: %s holds %d volumes after its drain:\n%s", x, held, out)
			}
		}
		fio := s.stopFio("sp-fio", 2)
		t.Logf("spread: fio --verify across the drain of %s (its volume copied to %s and switched over): %s verified rounds, 0 errors, longest I/O %v",
			x, y, s.fioRounds("sp-fio", fio), longestIO(fio))
		if out, err := s.mpnbdctl("uncordon", x); err != nil {
			t.Errorf("mpnbdctl uncordon %s: %v\n%s", x, err, out)
		}
		s.kubectl("delete", "pod", "sp-fio", "--wait=true", "--timeout=120s")
		s.kubectl("delete", "pvc", "sp-1", "sp-2", "sp-3", "--wait=true", "--timeout=120s")
	})
}
