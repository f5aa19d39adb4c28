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
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

// pod returns a pod of the driver's image running script with the claim
// mounted at /data (Filesystem) or attached at /dev/xvda (Block).
func pod(name, claim, script string, block bool) string {
	vol := `volumeMounts: [{name: data, mountPath: /data}]`
	if block {
		vol = `volumeDevices: [{name: data, devicePath: /dev/xvda}]`
	}
	return podSpec(name, "", script, vol, fmt.Sprintf("{name: data, persistentVolumeClaim: {claimName: %s}}", claim))
}

// podSpec returns a pod of the driver's image named name (with the
// metadata fields extra, if any) running script, its container's
// volumes as uses (volumeMounts or volumeDevices) of the pod's volumes.
func podSpec(name, extra, script, uses, volumes string) string {
	if extra != "" {
		extra = ", " + extra
	}
	return fmt.Sprintf(`apiVersion: v1
kind: Pod
metadata: {name: %s, namespace: default%s}
spec:
  restartPolicy: Never
  terminationGracePeriodSeconds: 1
  containers:
    - name: main
      image: %s
      imagePullPolicy: Never
      # As root: the image's default user is the controller's (65532),
      # and a claim's new filesystem belongs to root.
      securityContext: {runAsUser: 0}
      command: ["/bin/sh", "-c", %q]
      %s
  volumes: [%s]
`, name, extra, driverImage, script, uses, volumes)
}

// fuseClass is a StorageClass of the fuse transport with the encryption
// and volume binding mode given, and the parameters extra
// ("key: value, ..." or "").
func fuseClass(name, encryption, binding, extra string) string {
	if extra != "" {
		extra = ", " + extra
	}
	return fmt.Sprintf(`apiVersion: storage.k8s.io/v1
kind: StorageClass
metadata: {name: %s}
provisioner: nbd.mptcp.mpnbd.io
parameters: {encryption: %s, transport: fuse%s}
volumeBindingMode: %s
`, name, encryption, extra, binding)
}

func pvc(name, class, size string, block bool) string {
	mode := "Filesystem"
	if block {
		mode = "Block"
	}
	return fmt.Sprintf(`apiVersion: v1
kind: PersistentVolumeClaim
metadata: {name: %s, namespace: default}
spec:
  accessModes: [ReadWriteOnce]
  volumeMode: %s
  storageClassName: %s
  resources: {requests: {storage: %s}}
`, name, mode, class, size)
}

// runPod runs a pod to completion and returns its log.
func (s *suite) runPod(name, manifest string) string {
	s.t.Helper()
	s.apply(manifest)
	out := s.waitPod(name, 5*time.Minute)
	s.kubectl("delete", "pod", name, "--wait=true", "--timeout=120s")
	return out
}

// waitPod waits (bounded) for a pod to succeed and returns its log; a
// failed pod fails the test with its log.
func (s *suite) waitPod(name string, timeout time.Duration) string {
	s.t.Helper()
	s.waitFor("pod "+name+" to finish", timeout, func() string {
		switch p := s.jsonpath("{.status.phase}", "get", "pod", name); p {
		case "Succeeded":
			return ""
		case "Failed":
			out, _ := s.c.Kubectl(s.ctx, "logs", name)
			s.t.Fatalf("pod %s failed: %s", name, out)
		default:
			return "phase " + p
		}
		return ""
	})
	return s.kubectl("logs", name)
}

// startPod starts a long-running pod and waits until it runs.
func (s *suite) startPod(name, manifest string) {
	s.t.Helper()
	s.apply(manifest)
	s.waitFor("pod "+name+" running", 5*time.Minute, func() string {
		if p := s.jsonpath("{.status.phase}", "get", "pod", name); p != "Running" {
			return "phase " + p
		}
		return ""
	})
}

// writeReadBack: a pod writes a file of 64 MiB to claim and prints its
// checksum; a new pod on the claim reads the same back.
func (s *suite) writeReadBack(scenario, claim string) {
	t := s.t
	var sum string
	s.step(scenario+": write from a pod", func() {
		out := s.runPod(claim+"-writer", pod(claim+"-writer", claim,
			`head -c 64M /dev/urandom > /data/file && sync && echo sum=$(sha256sum /data/file | cut -d' ' -f1)`, false))
		if sum = field(out, "sum"); len(sum) != 64 {
			t.Fatalf("writer output %q", out)
		}
	})
	s.step(scenario+": read back from a new pod", func() {
		out := s.runPod(claim+"-reader", pod(claim+"-reader", claim, `echo sum=$(sha256sum /data/file | cut -d' ' -f1)`, false))
		if got := field(out, "sum"); got != sum {
			t.Fatalf("read back sha256 %q, want %q", got, sum)
		}
	})
}

func field(out, key string) string {
	for _, l := range strings.Split(out, "\n") {
		if v, ok := strings.CutPrefix(strings.TrimSpace(l), key+"="); ok {
			return v
		}
	}
	return ""
}

// filesystemScenario: a pod writes a file with its checksum; a new pod
// on the same claim reads it back; the claim is expanded online and the
// running pod sees the new size; the volume's connection has one MPTCP
// subflow per path.
func (s *suite) filesystemScenario() {
	s.apply(pvc("fs", "mpnbd-ext4", "1Gi", false))
	s.writeReadBack("filesystem", "fs")
	s.step("filesystem: one MPTCP subflow per path", func() {
		// It writes 32 MiB, which the CLI's bytes per path account for.
		s.startPod("fs-app", pod("fs-app", "fs", `head -c 32M /dev/urandom > /data/app && sync && sleep 3600`, false))
		s.waitFor("4 MPTCP subflows", time.Minute, func() string {
			if n := establishedSubflows(); n != paths {
				return fmt.Sprintf("%d established subflows to the agent, want %d", n, paths)
			}
			return ""
		})
		// The node plugin says the same: a volume with fewer subflows
		// than its storage node's addresses is DEGRADED.
		id := s.jsonpath("{.spec.volumeName}", "get", "pvc", "fs")
		s.waitFor("a healthy volume", time.Minute, func() string {
			h, err := s.nodeVolumeHealth(id)
			if err != nil {
				return err.Error()
			}
			if len(h.GetHealthStatuses()) != 0 {
				return fmt.Sprintf("volume health %v", h.GetHealthStatuses())
			}
			return ""
		})
		// And its metrics: 4 subflows on the volume's one connection,
		// as many as expected, not degraded.
		s.waitFor("the node plugin's metrics", time.Minute, func() string {
			m, err := s.nodeMetrics()
			if err != nil {
				return err.Error()
			}
			for _, w := range []string{
				fmt.Sprintf(`mpnbd_node_volume_subflows{connection="0",transport="fuse",volume=%q} %d`, id, paths),
				fmt.Sprintf(`mpnbd_node_volume_expected_subflows{transport="fuse",volume=%q} %d`, id, paths),
				fmt.Sprintf(`mpnbd_node_volume_degraded{transport="fuse",volume=%q} 0`, id),
			} {
				if !strings.Contains(m, w) {
					return "no " + w
				}
			}
			return ""
		})
		// What a user sees: the claim's Events say which transport the
		// stage chose, and -o wide shows it with the subflows.
		s.waitFor("TransportChosen on the claim", time.Minute, func() string {
			out := s.kubectl("describe", "pvc", "fs")
			if !strings.Contains(out, "TransportChosen") || !strings.Contains(out, "attached with transport fuse") {
				return "describe pvc:\n" + out
			}
			return ""
		})
		s.waitFor("transport and subflows in kubectl get nbdvol -o wide", time.Minute, func() string {
			out := s.kubectl("get", "nbdvol", id, "-o", "wide")
			if cells := wideCells(out, "TRANSPORT", "SUBFLOWS"); cells[0] != "fuse" || cells[1] != fmt.Sprintf("%d/%d", paths, paths) {
				return "get nbdvol -o wide:\n" + out
			}
			return ""
		})
		// The node's info metric names the claim, the storage node and
		// the loop device (node_exporter's device label).
		s.waitFor("the claim and the device in mpnbd_node_volume_info", time.Minute, func() string {
			out, err := s.nodeMetrics()
			if err != nil {
				return err.Error()
			}
			for _, l := range strings.Split(out, "\n") {
				if strings.HasPrefix(l, "mpnbd_node_volume_info{") && strings.Contains(l, `volume="`+id+`"`) {
					if !strings.Contains(l, `device="loop`) || !strings.Contains(l, `namespace="default"`) || !strings.Contains(l, `pvc="fs"`) ||
						!strings.Contains(l, `storage_node="`+s.c.NodeName+`"`) {
						return "info: " + l
					}
					return ""
				}
			}
			return "no mpnbd_node_volume_info of " + id
		})
		// And the operator's CLI.
		s.checkCLI("fs", id, 32<<20)
		s.kubectl("delete", "pod", "fs-app", "--wait=true", "--timeout=120s")
		s.waitFor("the node's status entry removed at unstage", 2*time.Minute, func() string {
			if a := s.jsonpath("{.status.attachments}", "get", "nbdvol", id); a != "" {
				return "attachments " + a
			}
			return ""
		})
	})
}

// wideCells returns the cells of the named columns in the first row of
// kubectl's table output (a cell starts where its header does).
func wideCells(out string, names ...string) []string {
	lines := strings.Split(strings.TrimSpace(out), "\n")
	cells := make([]string, len(names))
	if len(lines) < 2 {
		return cells
	}
	for i, n := range names {
		at := strings.Index(lines[0], n)
		if at < 0 || at >= len(lines[1]) {
			continue
		}
		if f := strings.Fields(lines[1][at:]); len(f) > 0 {
			cells[i] = f[0]
		}
	}
	return cells
}

// nodeMetrics scrapes the node plugin's metrics.
func (s *suite) nodeMetrics() (string, error) {
	resp, err := http.Get(s.nodeMetricsURL())
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return string(b), err
}

// expandScenario: a claim in use is expanded; the running pod sees the
// grown filesystem. XFS: growing a mounted ext4 needs CAP_SYS_RESOURCE,
// which root lacks on this machine (the VM suite grows ext4 online).
func (s *suite) expandScenario() {
	s.apply(pvc("grow", "mpnbd-xfs", "1Gi", false))
	s.step("online expansion (xfs)", func() {
		s.startPod("grow-app", pod("grow-app", "grow", `while true; do df -B1 --output=size /data | tail -1 > /tmp/size; sleep 1; done`, false))
		var before int64
		s.waitFor("the pod's first size report", time.Minute, func() string {
			if before = s.podSize("grow-app"); before == 0 {
				return "no size yet"
			}
			return ""
		})
		s.kubectl("patch", "pvc", "grow", "--type=merge", "-p", `{"spec":{"resources":{"requests":{"storage":"2Gi"}}}}`)
		s.waitFor("the pod to see the grown filesystem", 5*time.Minute, func() string {
			if now := s.podSize("grow-app"); now < before+(900<<20) {
				return fmt.Sprintf("filesystem size %d, was %d", now, before)
			}
			if c := s.jsonpath("{.status.capacity.storage}", "get", "pvc", "grow"); c != "2Gi" {
				return "PVC capacity " + c
			}
			return ""
		})
		s.kubectl("delete", "pod", "grow-app", "--wait=true", "--timeout=120s")
	})
}

func (s *suite) podSize(name string) int64 {
	out, err := s.c.Kubectl(s.ctx, "exec", name, "--", "cat", "/tmp/size")
	if err != nil {
		return 0
	}
	n, _ := strconv.ParseInt(strings.TrimSpace(out), 10, 64)
	return n
}

// establishedSubflows counts the host's established TCP subflows to the
// agent's NBD port on the suite's paths.
func establishedSubflows() int {
	out, err := exec.Command("ss", "-tnH", "state", "established", "dport", "= :10809").Output()
	if err != nil {
		return -1
	}
	n := 0
	for _, l := range strings.Split(string(out), "\n") {
		if strings.Contains(l, "10.77.") {
			n++
		}
	}
	return n
}

// blockScenario: a pod writes the raw device; a new pod reads it back.
func (s *suite) blockScenario() {
	t := s.t
	s.apply(pvc("raw", "mpnbd-block", "256Mi", true))
	var sum string
	s.step("block: write the raw device from a pod", func() {
		out := s.runPod("raw-writer", pod("raw-writer", "raw",
			`head -c 32M /dev/urandom > /tmp/d && dd if=/tmp/d of=/dev/xvda bs=1M oflag=direct status=none && echo sum=$(sha256sum /tmp/d | cut -d' ' -f1) && echo size=$(blockdev --getsize64 /dev/xvda)`, true))
		if sum = field(out, "sum"); len(sum) != 64 {
			t.Fatalf("writer output %q", out)
		}
		if size := field(out, "size"); size != strconv.Itoa(256<<20) {
			t.Errorf("block device size %s, want %d", size, 256<<20)
		}
	})
	s.step("block: read back from a new pod", func() {
		out := s.runPod("raw-reader", pod("raw-reader", "raw",
			`echo sum=$(head -c 32M /dev/xvda | sha256sum | cut -d' ' -f1)`, true))
		if got := field(out, "sum"); got != sum {
			t.Fatalf("read back sha256 %q, want %q", got, sum)
		}
	})
}

// deleteScenario: deleting the claims removes the volumes, their backing
// files and exports, and leaves no mount, loop device or serving process
// on the node.
func (s *suite) deleteScenario(dataDir, stateDir string) {
	s.step("delete the claims", func() {
		s.kubectl("delete", "pvc", "fs", "raw", "grow", "--wait=true", "--timeout=180s")
		s.waitFor("volumes and backing files gone", 3*time.Minute, func() string {
			if pvs := s.jsonpath("{.items[*].metadata.name}", "get", "pv"); pvs != "" {
				return "PVs left: " + pvs
			}
			if v := s.jsonpath("{.items[*].metadata.name}", "get", "nbdvolumes"); v != "" {
				return "NBDVolumes left: " + v
			}
			files, _ := filepath.Glob(filepath.Join(dataDir, "*.img"))
			if len(files) > 0 {
				return fmt.Sprintf("backing files left: %v", files)
			}
			return ""
		})
		s.waitFor("nothing left on the node", 2*time.Minute, func() string {
			mounts, _ := os.ReadFile("/proc/self/mountinfo")
			for _, l := range strings.Split(string(mounts), "\n") {
				if strings.Contains(l, "nbd.mptcp.mpnbd.io") || strings.Contains(l, stateDir) {
					return "mount left: " + l
				}
			}
			loops, _ := exec.Command("losetup", "-a").Output()
			if strings.Contains(string(loops), stateDir) {
				return "loop device left: " + string(loops)
			}
			if n := establishedSubflows(); n > 0 {
				return fmt.Sprintf("%d connections to the agent left", n)
			}
			return ""
		})
	})
}

// nodeVolumeHealth asks the node plugin, on its CSI socket, for a volume's
// health.
func (s *suite) nodeVolumeHealth(volumeID string) (*csi.VolumeHealth, error) {
	sock := filepath.Join(s.c.KubeletRoot(), "plugins", "nbd.mptcp.mpnbd.io", "csi.sock")
	conn, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return nil, err
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(s.ctx, 10*time.Second)
	defer cancel()
	resp, err := csi.NewNodeClient(conn).NodeGetVolumeHealth(ctx, &csi.NodeGetVolumeHealthRequest{VolumeId: volumeID})
	if err != nil {
		return nil, err
	}
	return resp.GetVolumeHealth(), nil
}
