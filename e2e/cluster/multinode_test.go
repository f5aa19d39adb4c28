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
	"bufio"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/mpnbd/mpnbd/internal/testenv/repo"
)

// envNodesOnly, a regexp, runs only TestDriverOnNodes's scenarios whose
// names (kube, rwo, shared, death, partition, storage, spread, restarts,
// replicas, lost) it matches.
const envNodesOnly = "MPNBD_NODES_ONLY"

// TestDriverOnNodes installs the driver with its Helm chart on a cluster
// of four nodes, each a host of its own (Node): node-a and node-b are
// storage nodes, node-c and node-d workers only (node-d runs the
// controller), every node with four 1 Gbit storage NICs. First
// Kubernetes' own storage suites for external drivers
// (kubeStorageScenario), with pods on any node; then what only several
// nodes can show: a ReadWriteOnce volume used from two nodes in
// turn (the second pod waits, Multi-Attach, until the first is gone, then
// reads its data); ReadWriteMany Block on two nodes at once,
// ReadWriteOncePod across two, and ReadOnlyMany (a clone of a written
// volume) read on two at once; a worker node that dies, or is cut off,
// under a writer (its pod moved by the out-of-service taint to another
// node, which reads every write acknowledged before the loss; the node,
// back, fenced: none of its old session's writes lands); a storage node
// that dies under fio --verify on an unreplicated volume (the I/O waits
// and goes on when it is back, what an operator sees meanwhile checked);
// and one that dies under fio --verify on a replicated volume it is the
// primary of (failed over, no I/O error; back, copied in sync again); and
// one stopped for good under fio --verify (failed over, forgotten, its
// replica replaced on a storage node that joined, which is then drained).
func TestDriverOnNodes(t *testing.T) {
	requireCluster(t)
	helm, rootfs, sidecars := suiteTools(t)
	limit := 35 * time.Minute
	if os.Getenv(envKubeStorageFocus) == "all" {
		limit += kubeStorageAllLimit
	}
	ctx, cancel := context.WithTimeout(context.Background(), limit)
	defer cancel()
	root, err := repo.Root()
	if err != nil {
		t.Fatal(err)
	}
	s := &suite{t: t, dir: t.TempDir(), ctx: ctx, helmBin: helm, chart: filepath.Join(root, "charts", "mpnbd")}
	before := hostState(t)
	defer s.summary(before)
	_, driverBuilt := s.buildDriverImage()
	s.step("cluster up: four nodes", func() {
		c, err := Up(ctx, Config{Dir: filepath.Join(s.dir, "cluster"), KubeBin: KubeBin(), Log: testLog{t}, Nodes: []NodeConfig{
			{Name: "node-a", Labels: map[string]string{"mpnbd.io/storage-node": "true"}},
			{Name: "node-b", Labels: map[string]string{"mpnbd.io/storage-node": "true"}},
			{Name: "node-c"},
			{Name: "node-d"},
		}})
		if err != nil {
			t.Fatalf("up: %v", err)
		}
		s.c = c
	})
	defer s.down()
	// The controller's sidecars only where it runs (node-d).
	sidecarImages := s.importImages(driverBuilt, rootfs, sidecars, "node-d")
	s.installSnapshotAPI(sidecars, MgmtGateway, "node-d")
	s.step("helm install", func() {
		var cidrs []string
		for i := 1; i <= StoragePaths; i++ {
			cidrs = append(cidrs, StorageCIDR(i))
		}
		// Every node's storage addresses by subnet (one value for all):
		// clients dial path 1, the agents announce paths 2..4.
		s.writeValues(valuesHead(sidecarImages, MgmtGateway) + fmt.Sprintf(`controller:
  hostNetwork: true
  # Where the test kills no node.
  nodeSelector: {kubernetes.io/hostname: node-d}
node:
  transports: [fuse]
  storageNICs: [%s]
  storageAddresses: [%s]
storageAgent:
  storageAddressesFrom: ""
  storageAddresses: [%s]
  signalNICs: [%s]
`, strings.Join(cidrs, ","), strings.Join(cidrs, ","), cidrs[0], strings.Join(cidrs[1:], ",")))
		if out, err := s.helm("install", "mpnbd", s.chart, "--create-namespace", "--values", s.values,
			"--set", "sidecars.snapshotter.image="+sidecarImages["csi-snapshotter"], "--wait=false"); err != nil {
			t.Fatalf("helm install: %v\n%s", err, out)
		}
	})
	s.step("driver ready on every node", func() {
		var names []string
		for _, n := range s.c.Nodes {
			names = append(names, n.Name)
		}
		s.waitDriverReady([]string{"node-a", "node-b"}, names)
		if got := s.jsonpath("{.items[*].spec.nodeName}", "get", "pods", "-n", namespace, "-l", "app.kubernetes.io/component=storage-agent"); got != "node-a node-b" && got != "node-b node-a" {
			t.Fatalf("storage agents on %q, want node-a and node-b", got)
		}
	})
	only := regexp.MustCompile(os.Getenv(envNodesOnly))
	for _, sc := range []struct {
		name string
		run  func()
	}{
		{"kube", s.kubeStorageScenario},
		{"rwo", s.rwoAcrossNodesScenario},
		{"shared", s.sharedAccessScenario},
		{"death", func() { s.nodeLossScenario(true) }},
		{"partition", func() { s.nodeLossScenario(false) }},
		{"storage", s.storageLossScenario},
		{"spread", s.spreadScenario},
		{"restarts", s.restartsScenario},
		{"replicas", s.replicaFailoverScenario},
		{"lost", s.replicaLostScenario},
	} {
		if only.MatchString(sc.name) {
			sc.run()
		} else {
			t.Logf("scenario %s not run (%s=%s)", sc.name, envNodesOnly, only)
		}
	}
	s.step("uninstall", func() {
		s.waitFor("every volume deleted", 3*time.Minute, func() string {
			if left := s.jsonpath("{.items[*].metadata.name}", "get", "pv,nbdvolumes"); left != "" {
				return "left: " + left
			}
			return ""
		})
		if out, err := s.helm("uninstall", "mpnbd", "--wait", "--timeout=3m"); err != nil {
			t.Fatalf("helm uninstall: %v\n%s", err, out)
		}
	})
}

// onNode pins a pod manifest to a node (by its hostname label, through
// the scheduler, as a user would).
func onNode(manifest, node string) string {
	return strings.Replace(manifest, "\nspec:\n", "\nspec:\n  nodeSelector: {kubernetes.io/hostname: "+node+"}\n", 1)
}

// rwoAcrossNodesScenario: a pod on node-a writes a file to a
// ReadWriteOnce claim and stays; a pod on node-b for the same claim waits
// with a Multi-Attach error until the first pod is deleted, then runs and
// reads the same file back.
func (s *suite) rwoAcrossNodesScenario() {
	t := s.t
	s.apply(pvc("rwo", "mpnbd-ext4", "256Mi", false))
	var sum string
	s.step("rwo: a pod on node-a writes and stays", func() {
		s.startPod("rwo-a", onNode(pod("rwo-a", "rwo",
			`head -c 64M /dev/urandom > /data/file && sync && echo sum=$(sha256sum /data/file | cut -d' ' -f1) && sleep 3600`, false), "node-a"))
		s.waitFor("the writer's checksum", 2*time.Minute, func() string {
			out, _ := s.c.Kubectl(s.ctx, "logs", "rwo-a")
			if sum = field(out, "sum"); len(sum) != 64 {
				return "log: " + out
			}
			return ""
		})
	})
	s.step("rwo: a pod on node-b waits for the volume (Multi-Attach)", func() {
		s.apply(onNode(pod("rwo-b", "rwo", `echo sum=$(sha256sum /data/file | cut -d' ' -f1)`, false), "node-b"))
		s.waitEvent("rwo-b", "Multi-Attach")
		if p := s.jsonpath("{.status.phase}", "get", "pod", "rwo-b"); p != "Pending" {
			t.Fatalf("rwo-b is %s while rwo-a holds the volume on node-a", p)
		}
	})
	s.step("rwo: node-a's pod deleted, node-b's runs and reads the data", func() {
		deleted := time.Now()
		s.kubectl("delete", "pod", "rwo-a", "--wait=true", "--timeout=120s")
		out := s.waitPod("rwo-b", 5*time.Minute)
		if got := field(out, "sum"); got != sum {
			t.Fatalf("node-b read sha256 %q, node-a wrote %q", got, sum)
		}
		t.Logf("rwo: the volume moved from node-a to node-b in %v after the first pod's deletion", time.Since(deleted).Round(time.Second))
		s.kubectl("delete", "pod", "rwo-b", "--wait=true", "--timeout=120s")
		s.kubectl("delete", "pvc", "rwo", "--wait=true", "--timeout=120s")
	})
}

// withAccessMode gives a claim manifest (pvc) another access mode.
func withAccessMode(manifest, mode string) string {
	return strings.Replace(manifest, "accessModes: [ReadWriteOnce]", "accessModes: ["+mode+"]", 1)
}

// sharedAccessScenario: a ReadWriteMany Block volume used by pods on two
// nodes at once, each writing blocks the other reads back through its own
// attachment (O_DIRECT both ways); and a ReadWriteOncePod claim, whose
// second pod (on another node) is refused while the first runs, then
// runs once it is gone.
func (s *suite) sharedAccessScenario() {
	t := s.t
	s.step("rwx: a Block volume on node-a and node-b at once", func() {
		s.apply(withAccessMode(pvc("rwx", "mpnbd-block", "256Mi", true), "ReadWriteMany"))
		sleeper := func(name, node string) string {
			return onNode(strings.Replace(pod(name, "rwx", "sleep 3600", true), "image: "+driverImage, "image: "+fioImage, 1), node)
		}
		s.startPod("rwx-a", sleeper("rwx-a", "node-a"))
		s.startPod("rwx-b", sleeper("rwx-b", "node-b"))
		write := func(pod, gen string, from, to int) {
			s.kubectl("exec", pod, "--", "sh", "-c", blockPattern+fmt.Sprintf(`for i in $(seq %d %d); do pattern %s $i | dd of=/dev/xvda bs=64k seek=$i count=1 iflag=fullblock oflag=direct conv=fsync,notrunc status=none || exit 1; done`, from, to, gen))
		}
		check := func(pod, gen string, from, to int) {
			out := s.kubectl("exec", pod, "--", "sh", "-c", blockPattern+fmt.Sprintf(`bad=0
for i in $(seq %d %d); do
  pattern %s $i > /tmp/want
  dd if=/dev/xvda bs=64k skip=$i count=1 iflag=direct status=none | cmp -s /tmp/want - || bad=$((bad+1))
done
echo bad=$bad`, from, to, gen))
			if field(out, "bad") != "0" {
				t.Fatalf("%s reads blocks %d..%d not as written from the other node: %s", pod, from, to, out)
			}
		}
		write("rwx-a", "a", 1, 64)
		check("rwx-b", "a", 1, 64)
		write("rwx-b", "b", 65, 128)
		check("rwx-a", "b", 65, 128)
		if got := s.jsonpath("{.items[*].spec.nodeName}", "get", "volumeattachments"); !strings.Contains(got, "node-a") || !strings.Contains(got, "node-b") {
			t.Errorf("VolumeAttachments on %q, want node-a and node-b", got)
		}
		t.Logf("rwx: 128 blocks written on one node and read back on the other, both ways, both attached")
		s.kubectl("delete", "pod", "rwx-a", "rwx-b", "--wait=true", "--timeout=120s")
		s.kubectl("delete", "pvc", "rwx", "--wait=true", "--timeout=120s")
	})
	s.step("rwop: a second pod refused while the first runs, then runs", func() {
		s.apply(withAccessMode(pvc("rwop", "mpnbd-ext4", "256Mi", false), "ReadWriteOncePod"))
		s.startPod("rwop-a", onNode(pod("rwop-a", "rwop", "echo first > /data/who && sleep 3600", false), "node-a"))
		s.apply(onNode(pod("rwop-b", "rwop", "echo who=$(cat /data/who)", false), "node-b"))
		s.waitEvent("rwop-b", "ReadWriteOncePod")
		if p := s.jsonpath("{.status.phase}", "get", "pod", "rwop-b"); p != "Pending" {
			t.Fatalf("rwop-b is %s while rwop-a uses the ReadWriteOncePod claim", p)
		}
		s.kubectl("delete", "pod", "rwop-a", "--wait=true", "--timeout=120s")
		if who := field(s.waitPod("rwop-b", 5*time.Minute), "who"); who != "first" {
			t.Fatalf("rwop-b read %q", who)
		}
		s.kubectl("delete", "pod", "rwop-b", "--wait=true", "--timeout=120s")
		s.kubectl("delete", "pvc", "rwop", "--wait=true", "--timeout=120s")
	})
	s.step("rox: a written volume's clone read on node-a and node-c at once, read-only", func() {
		s.apply(pvc("rox-src", "mpnbd-ext4", "256Mi", false))
		sum := field(s.runPod("rox-w", onNode(pod("rox-w", "rox-src",
			`head -c 32M /dev/urandom > /data/file && sync && echo sum=$(sha256sum /data/file | cut -d' ' -f1)`, false), "node-a")), "sum")
		if len(sum) != 64 {
			t.Fatalf("the writer printed sum %q", sum)
		}
		s.apply(withAccessMode(pvcFrom("rox", "mpnbd-ext4", "256Mi", "PersistentVolumeClaim", "rox-src"), "ReadOnlyMany"))
		reader := func(name, node string) string {
			return onNode(podSpec(name, "", `echo sum=$(sha256sum /data/file | cut -d' ' -f1)
if touch /data/new 2>/dev/null; then echo writable=yes; else echo writable=no; fi
sleep 3600`, `volumeMounts: [{name: data, mountPath: /data, readOnly: true}]`,
				"{name: data, persistentVolumeClaim: {claimName: rox, readOnly: true}}"), node)
		}
		s.startPod("rox-a", reader("rox-a", "node-a"))
		s.startPod("rox-c", reader("rox-c", "node-c"))
		for _, p := range []string{"rox-a", "rox-c"} {
			var out string
			s.waitFor(p+" to read the file", 2*time.Minute, func() string {
				out, _ = s.c.Kubectl(s.ctx, "logs", p)
				if field(out, "writable") == "" {
					return "log: " + out
				}
				return ""
			})
			if got, w := field(out, "sum"), field(out, "writable"); got != sum || w != "no" {
				t.Fatalf("%s read sha256 %q (want %q) and found the volume writable=%s (want no)", p, got, sum, w)
			}
		}
		pv := s.jsonpath("{.spec.volumeName}", "get", "pvc", "rox")
		var on []string
		for _, va := range strings.Fields(s.jsonpath(`{range .items[*]}{.spec.source.persistentVolumeName}/{.spec.nodeName}{" "}{end}`, "get", "volumeattachments")) {
			if v, node, _ := strings.Cut(va, "/"); v == pv {
				on = append(on, node)
			}
		}
		if slices.Sort(on); !slices.Equal(on, []string{"node-a", "node-c"}) {
			t.Errorf("the clone is attached on %v, want node-a and node-c", on)
		}
		t.Logf("rox: the clone read on node-a and node-c at once, the same sha256 as written, read-only on both")
		s.kubectl("delete", "pod", "rox-a", "rox-c", "--wait=true", "--timeout=120s")
		s.kubectl("delete", "pvc", "rox", "rox-src", "--wait=true", "--timeout=120s")
	})
}

// blockPattern is a shell function writing the 64 KiB content of block
// $2 of generation $1 ("old", "new") to stdout. (dd reads it with
// iflag=fullblock: a pipe's read may return less than a block.)
const blockPattern = `pattern() { yes "$1-$2" | head -c 65536; }
`

// checkBlocksScript compares blocks 1..n of /dev/xvda with generation gen
// and prints bad=<count>.
func checkBlocksScript(gen string, n int) string {
	return blockPattern + fmt.Sprintf(`bad=0
for i in $(seq 1 %d); do
  pattern %s $i > /tmp/want
  dd if=/dev/xvda bs=64k skip=$i count=1 iflag=direct status=none > /tmp/got
  cmp -s /tmp/want /tmp/got || { bad=$((bad+1)); [ $bad -le 10 ] && echo "block $i differs: $(head -c 24 /tmp/got | od -An -c | tr -s ' ' | head -1)"; }
done
echo bad=$bad`, n, gen)
}

// nodeLossScenario: a pod on node-c writes numbered 64 KiB blocks to a
// Block volume, each with O_DIRECT and fsync, and says which it finished
// (the test follows its log); then node-c is lost: killed (power off:
// packets dropped, every process SIGKILLed) or, with kill false, cut off
// (packets dropped, its processes go on, its pending write waiting to be
// sent again). As an administrator would: the node NotReady, the
// out-of-service taint; the pod is deleted and the volume detached by
// force; a pod on node-b reads every block acknowledged before the loss
// and overwrites them with new data; node-c comes back (booted over its
// old state, or its links healed: its session dials again) and a minute
// later not one old block has come back: the old node is fenced.
func (s *suite) nodeLossScenario(kill bool) {
	t := s.t
	name, how := "partition", "is cut off"
	if kill {
		name, how = "death", "dies"
	}
	claim := name
	s.apply(pvc(claim, "mpnbd-block", "256Mi", true))
	writer := blockPattern + `i=0
while [ $i -lt 3000 ]; do
  i=$((i+1))
  pattern old $i | dd of=/dev/xvda bs=64k seek=$i count=1 iflag=fullblock oflag=direct conv=fsync,notrunc status=none || { echo "write $i failed"; exit 1; }
  echo acked=$i
  sleep 0.02
done
sleep 3600`
	var acked int
	var mu sync.Mutex
	w, r := name+"-w", name+"-r"
	s.step(name+": a writer on node-c", func() {
		s.startPod(w, onNode(strings.Replace(pod(w, claim, writer, true), "image: "+driverImage, "image: "+fioImage, 1), "node-c"))
		// Follow the writer's acknowledgements as they come (the node's
		// log is gone with it).
		follow := exec.CommandContext(s.ctx, filepath.Join(KubeBin(), "kubectl"), "--kubeconfig", s.c.Kubeconfig, "logs", "-f", w)
		out, err := follow.StdoutPipe()
		if err != nil {
			t.Fatal(err)
		}
		if err := follow.Start(); err != nil {
			t.Fatal(err)
		}
		go func() {
			sc := bufio.NewScanner(out)
			for sc.Scan() {
				if v, ok := strings.CutPrefix(sc.Text(), "acked="); ok {
					if n, err := strconv.Atoi(v); err == nil {
						mu.Lock()
						acked = n
						mu.Unlock()
					}
				}
			}
			_ = follow.Wait() // ends with the node, or at the test's end
		}()
		s.waitFor("the writer to acknowledge 200 blocks", 2*time.Minute, func() string {
			mu.Lock()
			defer mu.Unlock()
			if acked < 200 {
				return fmt.Sprintf("acked %d", acked)
			}
			return ""
		})
	})
	cn := s.c.Nodes[2]
	var lost time.Time
	var ackedAtLoss int
	s.step(name+": node-c "+how+" under the writer", func() {
		lost = time.Now()
		var err error
		if kill {
			err = cn.Kill()
		} else {
			err = cn.Cut()
		}
		if err != nil {
			t.Fatal(err)
		}
		if kill {
			// Its loop devices went with it, as with a host's power.
			pv := s.jsonpath("{.spec.volumeName}", "get", "pvc", claim)
			if left := loopsBacking(pv); len(left) > 0 {
				t.Errorf("loop devices of the dead node's volume %s still bound: %v", pv, left)
			}
		}
		// The last acknowledgement may still be on its way to the test.
		time.Sleep(2 * time.Second)
		mu.Lock()
		ackedAtLoss = acked
		mu.Unlock()
		t.Logf("%s: %d blocks acknowledged before node-c %s", name, ackedAtLoss, how)
		s.waitFor("node-c NotReady", NodeMonitorGrace+time.Minute, func() string {
			if r := s.jsonpath(`{.status.conditions[?(@.type=="Ready")].status}`, "get", "node", "node-c"); r == "True" {
				return "Ready=" + r
			}
			return ""
		})
		t.Logf("%s: node-c NotReady %v later", name, time.Since(lost).Round(time.Second))
	})
	s.step(name+": out-of-service taint; the pod and the attachment go", func() {
		s.kubectl("taint", "node", "node-c", "node.kubernetes.io/out-of-service=nodeshutdown:NoExecute")
		s.waitFor("the writer pod deleted", 3*time.Minute, func() string {
			if _, err := s.c.Kubectl(s.ctx, "get", "pod", w); err == nil {
				return w + " still exists"
			}
			return ""
		})
		s.waitFor("the volume detached from node-c", 3*time.Minute, func() string {
			if va := s.jsonpath("{.items[?(@.spec.nodeName==\"node-c\")].metadata.name}", "get", "volumeattachments"); va != "" {
				return "VolumeAttachment " + va
			}
			return ""
		})
	})
	rewritten := ackedAtLoss + 50
	s.step(name+": node-b reads every acknowledged block, then overwrites them", func() {
		s.startPod(r, onNode(strings.Replace(pod(r, claim, checkBlocksScript("old", ackedAtLoss)+`
`+blockPattern+fmt.Sprintf(`for i in $(seq 1 %d); do pattern new $i | dd of=/dev/xvda bs=64k seek=$i count=1 iflag=fullblock oflag=direct conv=fsync,notrunc status=none || exit 1; done
echo rewritten
sleep 3600`, rewritten), true), "image: "+driverImage, "image: "+fioImage, 1), "node-b"))
		t.Logf("%s: the volume's pod ran again on node-b %v after node-c %s", name, time.Since(lost).Round(time.Second), how)
		s.waitFor("the reader's check and rewrite", 5*time.Minute, func() string {
			out, _ := s.c.Kubectl(s.ctx, "logs", r)
			if bad := field(out, "bad"); bad != "" && bad != "0" {
				t.Fatalf("blocks acknowledged before node-c %s differ on node-b:\n%s", how, out)
			}
			if !strings.Contains(out, "rewritten") {
				return "log: " + lastLines([]byte(out), 3)
			}
			return ""
		})
	})
	s.step(name+": node-c back for a minute, fenced: no old block returns", func() {
		var err error
		if kill {
			err = cn.Revive(s.ctx)
		} else if err = cn.Heal(); err == nil {
			err = s.c.waitNodeReady(s.ctx, cn.Name)
		}
		if err != nil {
			t.Fatal(err)
		}
		back := time.Now()
		s.kubectl("taint", "node", "node-c", "node.kubernetes.io/out-of-service=nodeshutdown:NoExecute-")
		s.waitFor("node-c's datapath running", 3*time.Minute, func() string {
			if phase := s.jsonpath("{.items[?(@.spec.nodeName==\"node-c\")].status.phase}", "get", "pods", "-n", namespace, "-l", "app.kubernetes.io/component=datapath"); phase != "Running" {
				return "phase " + phase
			}
			return ""
		})
		time.Sleep(time.Minute - time.Since(back))
		dp := s.jsonpath("{.items[?(@.spec.nodeName==\"node-c\")].metadata.name}", "get", "pods", "-n", namespace, "-l", "app.kubernetes.io/component=datapath")
		out, _ := s.c.Kubectl(s.ctx, "logs", "-n", namespace, dp)
		pv := s.jsonpath("{.spec.volumeName}", "get", "pvc", claim)
		refused, fenced := 0, false
		for _, l := range strings.Split(out, "\n") {
			if strings.Contains(l, pv) && strings.Contains(l, "refused") {
				refused++
				fenced = fenced || strings.Contains(l, "superseded")
			}
		}
		t.Logf("%s: node-c's datapath since (its old session's dials refused %d times):\n%s", name, refused, lastLines([]byte(out), 6))
		if !kill && !fenced {
			// The session lived through the partition: its first dial
			// after it must end it (refused as superseded: I/O fails, the
			// writes it kept dropped), or its writer waits for ever.
			t.Errorf("node-c's old session of %s was not refused as superseded after the partition healed", pv)
		}
		check := s.kubectl("exec", r, "--", "sh", "-c", checkBlocksScript("new", rewritten))
		if field(check, "bad") != "0" {
			t.Fatalf("a minute after node-c came back, blocks differ from what node-b wrote:\n%s", check)
		}
		t.Logf("%s: all %d blocks as node-b wrote them a minute after node-c's return", name, rewritten)
		s.kubectl("delete", "pod", r, "--wait=true", "--timeout=120s")
		s.kubectl("delete", "pvc", claim, "--wait=true", "--timeout=120s")
	})
}

// replicaFailoverScenario: fio --verify=crc32c from node-d on a volume of
// two replicas (node-a and node-b) while the storage node holding its
// primary dies (packets dropped, every process SIGKILLed): the controller
// fails the volume over to the other replica, and fio sees no I/O error
// and no verify failure; the longest I/O wait is printed. The dead node
// comes back and its replica is copied back in sync.
func (s *suite) replicaFailoverScenario() {
	t := s.t
	var id, primary string
	s.step("replicas: two in sync under fio", func() {
		id, primary = s.replicatedUnderFio("repl", "repl-fio")
		time.Sleep(15 * time.Second)
	})
	dead := s.node(primary)
	s.step("replicas: the primary's storage node dies under fio", func() {
		after := s.killPrimary(id, dead)
		t.Logf("replicas: primary %s died; failed over to %s %v later", primary,
			s.jsonpath("{.status.replication.primary}", "get", "nbdvolume", id), after)
		out := s.stopFio("repl-fio", 3)
		rounds := s.fioRounds("repl-fio", out)
		t.Logf("replicas: fio --verify across the death of the primary's storage node: %s verified rounds, 0 errors, longest I/O %v", rounds, longestIO(out))
		s.kubectl("delete", "pod", "repl-fio", "--wait=true", "--timeout=120s")
	})
	s.step("replicas: the dead node back, its replica copied in sync", func() {
		back := time.Now()
		if err := dead.Revive(s.ctx); err != nil {
			t.Fatal(err)
		}
		s.waitFor("two replicas in sync again", 5*time.Minute, s.inSync(id, "2"))
		t.Logf("replicas: %s back and in sync %v after its return", primary, time.Since(back).Round(time.Second))
		s.kubectl("delete", "pvc", "repl", "--wait=true", "--timeout=120s")
	})
}

// replicatedUnderFio makes claim, a Block volume of two replicas (on
// node-a and node-b, the storage nodes), used by pod, fio --verify=crc32c
// on node-d (where no node is killed); it waits until both replicas are
// in sync and fio has verified a round, and returns the volume and the
// storage node of its primary.
func (s *suite) replicatedUnderFio(claim, pod string) (id, primary string) {
	s.apply(`apiVersion: storage.k8s.io/v1
kind: StorageClass
metadata: {name: mpnbd-replicated-block}
provisioner: nbd.mptcp.mpnbd.io
parameters: {transport: fuse, replicas: "2"}
`)
	s.apply(pvc(claim, "mpnbd-replicated-block", "256Mi", true))
	s.startPod(pod, onNode(fioPod(pod, claim, 20*time.Minute), "node-d"))
	id = s.jsonpath("{.spec.volumeName}", "get", "pvc", claim)
	s.waitFor("both replicas in sync", 3*time.Minute, s.inSync(id, "2"))
	primary = s.jsonpath("{.status.replication.primary}", "get", "nbdvolume", id)
	if primary != "node-a" && primary != "node-b" {
		s.t.Fatalf("primary %q", primary)
	}
	s.waitFor("fio's first verified round", 2*time.Minute, func() string {
		if out, _ := s.c.Kubectl(s.ctx, "logs", pod); !roundVerified.MatchString(out) {
			return "log: " + lastLines([]byte(out), 3)
		}
		return ""
	})
	return id, primary
}

// inSync is a waitFor condition: want replicas of volume id in sync.
func (s *suite) inSync(id, want string) func() string {
	return func() string {
		if n := s.jsonpath("{.status.replication.inSyncReplicas}", "get", "nbdvolume", id); n != want {
			return "in sync: " + n + "; replicas " + s.jsonpath("{.spec.replicaNodes}", "get", "nbdvolume", id)
		}
		return ""
	}
}

// killPrimary kills node, the storage node of volume id's primary, and
// returns how long after the kill the volume had another primary.
func (s *suite) killPrimary(id string, node *Node) time.Duration {
	killed := time.Now()
	if err := node.Kill(); err != nil {
		s.t.Fatal(err)
	}
	s.waitFor("the volume failed over", 2*time.Minute, func() string {
		if p := s.jsonpath("{.status.replication.primary}", "get", "nbdvolume", id); p == node.Name || p == "" {
			return "primary " + p
		}
		return ""
	})
	return time.Since(killed).Round(time.Second)
}

// loopsBacking lists the bound loop devices whose backing file's name
// holds name.
func loopsBacking(name string) []string {
	var out []string
	entries, _ := os.ReadDir("/sys/block")
	for _, e := range entries {
		if b, err := os.ReadFile(filepath.Join("/sys/block", e.Name(), "loop", "backing_file")); err == nil && strings.Contains(string(b), name) {
			out = append(out, e.Name())
		}
	}
	return out
}
