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
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/mpnbd/mpnbd/api/v1alpha1"
)

// fioImage is an image with fio, for the pods that verify data under
// faults.
const fioImage = "mpnbd.local/fio:e2e"

// fioFiles returns fio and the shared libraries it needs beyond glibc,
// from the host (Debian bookworm, like the image's base), under /opt/fio:
// path in the image -> host path. The base's /lib is a link into /usr,
// which a layer with a /lib directory would replace.
func fioFiles() (map[string]string, error) {
	fio, err := exec.LookPath("fio")
	if err != nil {
		return nil, fmt.Errorf("fio is not installed (apt-get install fio): %w", err)
	}
	files := map[string]string{"/opt/fio/bin/fio": fio}
	out, err := exec.Command("ldd", fio).Output()
	if err != nil {
		return nil, fmt.Errorf("ldd %s: %w", fio, err)
	}
	for _, l := range strings.Split(string(out), "\n") {
		for _, w := range strings.Fields(l) {
			if !strings.HasPrefix(w, "/") {
				continue
			}
			base := filepath.Base(w)
			if glibc.MatchString(base) {
				continue // the base image's own
			}
			if real, err := filepath.EvalSymlinks(w); err == nil {
				files["/opt/fio/lib/"+base] = real
			}
		}
	}
	return files, nil
}

// glibc matches the libraries of glibc, which the image's base has.
var glibc = regexp.MustCompile(`^(ld-linux.*|libc|libm|libpthread|libdl|librt|libresolv|libutil)\.so`)

// fioPod runs fio write+verify rounds on the claim's block device, a new
// random order each round, until it is told to stop (stopFio) or for at
// most d, and prints rounds=N when every round verified; a failed round
// fails the pod with fio's output. Each round prints its completion
// latency lines (longestIO) and "round N verified".
func fioPod(name, claim string, d time.Duration) string {
	script := fmt.Sprintf(`end=$(( $(date +%%s) + %d )); n=0
while [ "$(date +%%s)" -lt "$end" ] && [ ! -e %s ]; do
  n=$((n+1))
  LD_LIBRARY_PATH=/opt/fio/lib /opt/fio/bin/fio --name=verify --filename=/dev/xvda --direct=1 --ioengine=libaio --iodepth=16 --rw=randwrite --bs=4k \
    --size=32M --verify=crc32c --do_verify=1 --verify_fatal=1 --verify_state_save=0 --randrepeat=0 --randseed=$n \
    --output=/tmp/fio.out || { echo "round $n failed"; cat /tmp/fio.out; exit 1; }
  grep -q "err= 0" /tmp/fio.out || { echo "round $n reported an error"; cat /tmp/fio.out; exit 1; }
  grep -E "^ +clat \(" /tmp/fio.out | sed "s/^ */round $n /"
  echo "round $n verified"
done
echo rounds=$n`, int(d.Seconds()), fioStopFile)
	return strings.Replace(pod(name, claim, script, true), "image: "+driverImage, "image: "+fioImage, 1)
}

// fioStopFile, once it exists in a fioPod, ends its rounds.
const fioStopFile = "/tmp/fio-stop"

// roundVerified matches a fioPod's line for a round that verified.
var roundVerified = regexp.MustCompile(`(?m)^round [0-9]+ verified$`)

// stopFio lets a fioPod run more rounds after now (I/O after the faults
// before it), then tells it to stop, waits (bounded) for it to finish
// and returns its output.
func (s *suite) stopFio(name string, more int) string {
	s.t.Helper()
	verified := func() int {
		out, _ := s.c.Kubectl(s.ctx, "logs", name)
		return len(roundVerified.FindAllString(out, -1))
	}
	from := verified()
	s.waitFor(fmt.Sprintf("pod %s to verify %d more rounds", name, more), 5*time.Minute, func() string {
		if p := s.jsonpath("{.status.phase}", "get", "pod", name); p != "Running" {
			return "" // finished (or failed: waitPod says)
		}
		if n := verified() - from; n < more {
			return fmt.Sprintf("%d more rounds verified", n)
		}
		return ""
	})
	if _, err := s.c.Kubectl(s.ctx, "exec", name, "--", "touch", fioStopFile); err != nil {
		s.t.Logf("telling fio pod %s to stop: %v (it finished?)", name, err)
	}
	return s.waitPod(name, 3*time.Minute)
}

// clatLine is a completion latency line of fio's output:
// "clat (usec): min=40, max=4817.2k, avg=...".
var clatLine = regexp.MustCompile(`clat \((nsec|usec|msec)\): min=[^,]*, max=([0-9.]+)([kKmM]?),`)

// longestIO is the longest completion latency in fio's output: the
// longest a single I/O waited (through a failover: the pause).
func longestIO(out string) time.Duration {
	var longest time.Duration
	for _, m := range clatLine.FindAllStringSubmatch(out, -1) {
		v, err := strconv.ParseFloat(m[2], 64)
		if err != nil {
			continue
		}
		switch m[3] {
		case "k", "K":
			v *= 1e3
		case "m", "M":
			v *= 1e6
		}
		unit := map[string]float64{"nsec": 1, "usec": 1e3, "msec": 1e6}[m[1]]
		longest = max(longest, time.Duration(v*unit))
	}
	return longest
}

func TestLongestIO(t *testing.T) {
	out := `round 1    clat (usec): min=40, max=4817.2k, avg=1003.12, stdev=20.1
round 1    clat (msec): min=1, max=12, avg=2.00, stdev=0.1
round 2    clat (nsec): min=900, max=95000, avg=1000.00, stdev=1.1`
	if got, want := longestIO(out), 4817200*time.Microsecond; got != want {
		t.Errorf("longestIO = %v, want %v", got, want)
	}
	if got := longestIO("no latency here"); got != 0 {
		t.Errorf("longestIO of nothing = %v", got)
	}
}

// restartScenario: a pod runs fio --verify=crc32c on a volume while the
// node plugin's DaemonSet is restarted (kubectl rollout restart), then its
// pod deleted, then the datapath DaemonSet restarted, then the storage
// agent's pod deleted: no round sees an I/O error or a verify failure, and
// the plugin reports the volume healthy. The volumes' data path lives in
// the datapath DaemonSet, which the plugin's restarts do not touch; its
// own restart is a surge in which the new pod takes the volume over from
// the old one (a handover); the storage agent's restart is ridden out by
// the volume's NBD session (redial, replay, kept writes).
func (s *suite) restartScenario() {
	t := s.t
	s.apply(pvc("restart", "mpnbd-block", "256Mi", true))
	s.startPod("restart-fio", fioPod("restart-fio", "restart", 15*time.Minute))
	id := s.jsonpath("{.spec.volumeName}", "get", "pvc", "restart")
	time.Sleep(10 * time.Second)
	s.step("restart: rollout restart of the node plugin mid-fio", func() {
		s.kubectl("rollout", "restart", "daemonset/mpnbd-node", "-n", namespace)
		s.kubectl("rollout", "status", "daemonset/mpnbd-node", "-n", namespace, "--timeout=3m")
	})
	s.step("restart: delete the node plugin's pod mid-fio", func() {
		s.kubectl("delete", "pod", "-n", namespace, "-l", "app.kubernetes.io/component=node", "--wait=true", "--timeout=2m")
		s.kubectl("rollout", "status", "daemonset/mpnbd-node", "-n", namespace, "--timeout=3m")
	})
	s.step("restart: the new node plugin reports the volume healthy", func() {
		s.waitHealthy(id)
	})
	s.step("restart: rollout restart of the datapath mid-fio (a handover)", func() {
		old := s.jsonpath("{.items[0].metadata.name}", "get", "pods", "-n", namespace, "-l", "app.kubernetes.io/component=datapath")
		s.kubectl("rollout", "restart", "daemonset/mpnbd-datapath", "-n", namespace)
		s.kubectl("rollout", "status", "daemonset/mpnbd-datapath", "-n", namespace, "--timeout=4m")
		s.waitFor("the old datapath pod to go", 2*time.Minute, func() string {
			names := s.jsonpath("{.items[*].metadata.name}", "get", "pods", "-n", namespace, "-l", "app.kubernetes.io/component=datapath")
			if strings.Contains(names, old) {
				return "datapath pods " + names
			}
			return ""
		})
		logs := s.kubectl("logs", "-n", namespace, "-l", "app.kubernetes.io/component=datapath", "--tail=-1")
		if !takenOver(logs, id) {
			t.Fatalf("the new datapath did not take the volume over from %s:\n%s", old, logs)
		}
	})
	s.step("restart: the node plugin reports the volume healthy after the handover", func() {
		s.waitHealthy(id)
	})
	s.step("restart: delete the storage agent's pod mid-fio", func() {
		old := s.jsonpath("{.items[0].metadata.name}", "get", "pods", "-n", namespace, "-l", "app.kubernetes.io/component=storage-agent")
		s.kubectl("delete", "pod", "-n", namespace, old, "--wait=true", "--timeout=2m")
		s.followStorageAgent(old)
	})
	s.step("restart: the storage agent away mid-fio: its node not Ready, the volume not Reachable, one Event; then back", func() {
		s.storageAgentAway(id)
	})
	s.step("restart: fio finishes, every block verified", func() {
		rounds := s.fioRounds("restart-fio", s.stopFio("restart-fio", 2))
		t.Logf("fio across a node plugin rollout restart, a node plugin pod deletion, a datapath rollout restart (handover) and a storage agent pod deletion: %s verified rounds, 0 errors", rounds)
		s.kubectl("delete", "pod", "restart-fio", "--wait=true", "--timeout=120s")
		s.kubectl("delete", "pvc", "restart", "--wait=true", "--timeout=120s")
	})
}

// takenOver reports whether a datapath's log says it took volume id
// over from a predecessor.
func takenOver(logs, id string) bool {
	for _, l := range strings.Split(logs, "\n") {
		if strings.Contains(l, "volume taken from a predecessor") && strings.Contains(l, "volume_id="+id) {
			return true
		}
	}
	return false
}

// waitHealthy waits (bounded) until the node plugin reports volume id
// with no health condition.
func (s *suite) waitHealthy(id string) {
	s.waitFor("a healthy volume", 2*time.Minute, func() string {
		h, err := s.nodeVolumeHealth(id)
		if err != nil {
			return err.Error()
		}
		if len(h.GetHealthStatuses()) != 0 {
			return fmt.Sprintf("volume health %v", h.GetHealthStatuses())
		}
		return ""
	})
}

// storageAgentAway takes the storage agent off its node (a node selector
// that matches none) for longer than its lease, as a dead storage host
// would be to the controller, and brings it back: meanwhile the
// NBDStorageNode is not Ready (AgentNotReporting), volume id (served from
// it) not Reachable, and there is one StorageNodeNotReady Event on the
// storage node; then Ready again, with a StorageNodeReady Event.
func (s *suite) storageAgentAway(id string) {
	t := s.t
	events := func(reason string) int { return s.storageNodeEvents(s.c.NodeName, reason) }
	notReadyBefore, readyBefore := events("StorageNodeNotReady"), events("StorageNodeReady")
	old := s.agentAway()
	s.waitFor("the volume not Reachable", 30*time.Second, func() string {
		if r := s.jsonpath(`{.status.conditions[?(@.type=="Reachable")].status}`, "get", "nbdvol", id); r != "False" {
			return "Reachable " + r
		}
		return ""
	})
	t.Logf("kubectl get nbdnode, nbdvol while the agent is away:\n%s\n%s", s.kubectl("get", "nbdnode", "-o", "wide"), s.kubectl("get", "nbdvol", id, "-o", "wide"))
	s.agentBack(old)
	s.waitFor("the volume Reachable again", time.Minute, func() string {
		if r := s.jsonpath(`{.status.conditions[?(@.type=="Reachable")].status}`, "get", "nbdvol", id); r != "True" {
			return "Reachable " + r
		}
		return ""
	})
	s.waitFor("one StorageNodeNotReady and one StorageNodeReady Event on the storage node", 30*time.Second, func() string {
		if n, r := events("StorageNodeNotReady")-notReadyBefore, events("StorageNodeReady")-readyBefore; n != 1 || r != 1 {
			return fmt.Sprintf("%d StorageNodeNotReady and %d StorageNodeReady Events while the agent was away", n, r)
		}
		return ""
	})
}

// storageNodeEvents is how many times reason was recorded on storage node
// node's NBDStorageNode (the counts of its Event objects: repeats are
// counted on one object).
func (s *suite) storageNodeEvents(node, reason string) int {
	n := 0
	for _, c := range strings.Fields(s.jsonpath("{.items[*].count}", "get", "events", "-A",
		"--field-selector", "involvedObject.kind=NBDStorageNode,involvedObject.name="+node+",reason="+reason)) {
		k, _ := strconv.Atoi(c)
		n += k
	}
	return n
}

// storageReady is the storage node's Ready condition, "status/reason".
func (s *suite) storageReady() string {
	return s.jsonpath(`{.status.conditions[?(@.type=="Ready")].status}/{.status.conditions[?(@.type=="Ready")].reason}`, "get", "nbdnode", s.c.NodeName)
}

// agentAway takes the storage agent off its node (a node selector that
// matches none) and waits until the controller says its agent is not
// reporting (its lease expired). It returns the pod that went.
func (s *suite) agentAway() string {
	old := s.jsonpath("{.items[0].metadata.name}", "get", "pods", "-n", namespace, "-l", "app.kubernetes.io/component=storage-agent")
	s.kubectl("patch", "daemonset/mpnbd-storage-agent", "-n", namespace, "--type=json",
		"-p", `[{"op":"add","path":"/spec/template/spec/nodeSelector/mpnbd.io~1away","value":"true"}]`)
	s.waitFor("the storage node not Ready", 90*time.Second, func() string {
		if r := s.storageReady(); r != "False/"+v1alpha1.ReasonAgentNotReporting {
			return "Ready " + r
		}
		return ""
	})
	return old
}

// agentBack undoes agentAway and waits until the storage node is Ready.
func (s *suite) agentBack(old string) {
	s.kubectl("patch", "daemonset/mpnbd-storage-agent", "-n", namespace, "--type=json",
		"-p", `[{"op":"remove","path":"/spec/template/spec/nodeSelector/mpnbd.io~1away"}]`)
	s.followStorageAgent(old)
	s.waitFor("the storage node Ready again", 2*time.Minute, func() string {
		if r := s.storageReady(); r != "True/"+v1alpha1.ReasonAgentReporting {
			return "Ready " + r
		}
		return ""
	})
}

// lostForGoodScenario follows the runbook for a storage node gone for
// good (docs/operations.md): a claim is written and left detached; the
// storage agent is taken away until the controller says it is not
// reporting; mpnbdctl forget deletes its NBDStorageNode; deleting the
// claim then completes without the agent (the PV and the NBDVolume go, a
// BackingStoreWrittenOff Event on it). The agent brought back makes its
// NBDStorageNode anew and reports the claim's backing file as an orphan,
// which the operator deletes.
func (s *suite) lostForGoodScenario(dataDir string) {
	t := s.t
	var id, old string
	s.step("lost for good: a claim written and detached", func() {
		s.apply(pvc("lost", "mpnbd-block", "64Mi", true))
		s.runPod("lost-writer", pod("lost-writer", "lost", `head -c 1M /dev/urandom > /dev/xvda && sync && echo written=1`, true))
		id = s.jsonpath("{.spec.volumeName}", "get", "pvc", "lost")
		s.waitFor("the claim detached", 2*time.Minute, func() string {
			if va := s.jsonpath(`{.items[?(@.spec.source.persistentVolumeName=="`+id+`")].metadata.name}`, "get", "volumeattachment"); va != "" {
				return "VolumeAttachment " + va
			}
			return ""
		})
	})
	s.step("lost for good: mpnbdctl forget refuses while the agent reports", func() {
		if out, err := s.mpnbdctl("forget", s.c.NodeName); err == nil || !strings.Contains(out, "its storage agent reports") {
			t.Fatalf("mpnbdctl forget of a reporting node: %v\n%s", err, out)
		}
	})
	s.step("lost for good: the agent away, mpnbdctl forget, the claim deleted without it", func() {
		old = s.agentAway()
		out, err := s.mpnbdctl("forget", s.c.NodeName)
		if err != nil || !strings.Contains(out, "forgotten") || !strings.Contains(out, id+" (unreplicated)") {
			t.Fatalf("mpnbdctl forget: %v\n%s", err, out)
		}
		t.Logf("mpnbdctl forget %s:\n%s", s.c.NodeName, out)
		s.waitFor("the volume not Reachable, its storage node deleted", time.Minute, func() string {
			if r := s.jsonpath(`{.status.conditions[?(@.type=="Reachable")].reason}`, "get", "nbdvol", id); r != v1alpha1.ReasonStorageNodeDeleted {
				return "Reachable reason " + r
			}
			return ""
		})
		s.kubectl("delete", "pvc", "lost", "--wait=true", "--timeout=120s")
		s.waitFor("the PV and the NBDVolume gone", 3*time.Minute, func() string {
			if pv := s.jsonpath(`{.items[?(@.metadata.name=="`+id+`")].metadata.name}`, "get", "pv"); pv != "" {
				return "PV left: " + pv
			}
			if v := s.jsonpath(`{.items[?(@.metadata.name=="`+id+`")].metadata.name}`, "get", "nbdvol"); v != "" {
				return "NBDVolume left: " + v
			}
			return ""
		})
		if ev := s.jsonpath("{.items[*].reason}", "get", "events", "-A", "--field-selector",
			"involvedObject.kind=NBDVolume,involvedObject.name="+id+",reason=BackingStoreWrittenOff"); ev == "" {
			t.Errorf("no BackingStoreWrittenOff Event on %s", id)
		}
	})
	s.step("lost for good: the agent back reports the claim's file as an orphan, deleted by hand", func() {
		s.agentBack(old)
		s.waitFor("the orphan reported", 2*time.Minute, func() string {
			if o := s.jsonpath("{.status.orphans}", "get", "nbdnode", s.c.NodeName); !strings.Contains(o, id) {
				return "orphans " + o
			}
			return ""
		})
		if err := os.Remove(filepath.Join(dataDir, id+".img")); err != nil {
			t.Fatal(err)
		}
		s.waitFor("no orphan left", 2*time.Minute, func() string {
			if o := s.jsonpath("{.status.orphans}", "get", "nbdnode", s.c.NodeName); o != "" {
				return "orphans " + o
			}
			return ""
		})
	})
}
