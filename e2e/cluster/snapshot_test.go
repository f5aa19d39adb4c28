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
	"path/filepath"
	"strconv"
	"strings"
	"time"
)

// snapshotControllerImage is the real snapshot-controller, built by
// hack/sidecars.sh at the chart's csi-snapshotter release.
const snapshotControllerImage = "mpnbd.local/snapshot-controller:e2e"

// installSnapshotAPI installs what a cluster admin installs once for
// every CSI driver's snapshots: the snapshot.storage.k8s.io CRDs and the
// snapshot-controller with its RBAC, all of the snapshotter's release
// (hack/sidecars.sh, snapshot-manifests/).
func (s *suite) installSnapshotAPI(sidecars, apiHost, node string) {
	t := s.t
	s.step("the snapshot API: CRDs and snapshot-controller", func() {
		dir := filepath.Join(sidecars, "snapshot-manifests")
		crds, err := filepath.Glob(filepath.Join(dir, "snapshot.storage.k8s.io_*.yaml"))
		if err != nil || len(crds) != 3 {
			t.Fatalf("snapshot CRDs in %s: %v, %v", dir, crds, err)
		}
		for _, f := range append(crds, filepath.Join(dir, "rbac-snapshot-controller.yaml")) {
			s.kubectl("apply", "-f", f)
		}
		// The release's own Deployment, as a cluster without kube-proxy
		// runs it: on the host network, told where the API server is
		// (apiHost), on node when one is named (where its image is).
		placement := ""
		if node != "" {
			placement = "\n      nodeSelector: {kubernetes.io/hostname: " + node + "}"
		}
		s.apply(fmt.Sprintf(`apiVersion: apps/v1
kind: Deployment
metadata: {name: snapshot-controller, namespace: kube-system}
spec:
  replicas: 1
  selector: {matchLabels: {app.kubernetes.io/name: snapshot-controller}}
  template:
    metadata: {labels: {app.kubernetes.io/name: snapshot-controller}}
    spec:
      serviceAccountName: snapshot-controller
      hostNetwork: true%s
      containers:
        - name: snapshot-controller
          image: %s
          imagePullPolicy: Never
          args: ["--v=2", "--leader-election=false", "--http-endpoint=:9817"]
          env:
            - {name: KUBERNETES_SERVICE_HOST, value: %q}
            - {name: KUBERNETES_SERVICE_PORT, value: "%d"}
`, placement, snapshotControllerImage, apiHost, APIServerPort))
		for _, crd := range []string{"volumesnapshots", "volumesnapshotcontents", "volumesnapshotclasses"} {
			s.kubectl("wait", "--for=condition=Established", "--timeout=60s", "crd/"+crd+".snapshot.storage.k8s.io")
		}
		s.waitFor("the snapshot-controller", 3*time.Minute, func() string {
			if r := s.jsonpath("{.status.readyReplicas}", "get", "deploy", "-n", "kube-system", "snapshot-controller"); r != "1" {
				return "ready replicas " + r
			}
			return ""
		})
	})
}

func volumeSnapshot(name, claim string) string {
	return fmt.Sprintf(`apiVersion: snapshot.storage.k8s.io/v1
kind: VolumeSnapshot
metadata: {name: %s, namespace: default}
spec:
  volumeSnapshotClassName: mpnbd-snapshots
  source: {persistentVolumeClaimName: %s}
`, name, claim)
}

// pvcFrom is a Filesystem claim whose data comes from a VolumeSnapshot
// (kind VolumeSnapshot) or a claim (kind PersistentVolumeClaim).
func pvcFrom(name, class, size, kind, source string) string {
	group := ""
	if kind == "VolumeSnapshot" {
		group = "\n    apiGroup: snapshot.storage.k8s.io"
	}
	return fmt.Sprintf(`apiVersion: v1
kind: PersistentVolumeClaim
metadata: {name: %s, namespace: default}
spec:
  accessModes: [ReadWriteOnce]
  storageClassName: %s
  resources: {requests: {storage: %s}}
  dataSource:
    kind: %s
    name: %s%s
`, name, class, size, kind, source, group)
}

// waitSnapshotReady waits (bounded) for a VolumeSnapshot to be readyToUse
// and returns its bound VolumeSnapshotContent's snapshot handle.
func (s *suite) waitSnapshotReady(name string) string {
	s.t.Helper()
	s.waitFor("VolumeSnapshot "+name+" readyToUse", 3*time.Minute, func() string {
		if r := s.jsonpath("{.status.readyToUse}", "get", "volumesnapshot", name); r != "true" {
			return fmt.Sprintf("readyToUse %q, error %q", r, s.jsonpath("{.status.error.message}", "get", "volumesnapshot", name))
		}
		return ""
	})
	content := s.jsonpath("{.status.boundVolumeSnapshotContentName}", "get", "volumesnapshot", name)
	handle := s.jsonpath("{.status.snapshotHandle}", "get", "volumesnapshotcontent", content)
	if handle == "" {
		s.t.Fatalf("VolumeSnapshot %s: content %q has no snapshot handle", name, content)
	}
	return handle
}

// sums is the script that prints each file's sha256 (or "none") and
// the filesystem's size.
const sums = `for f in a b; do if [ -e /data/$f ]; then echo $f=$(sha256sum /data/$f | cut -d' ' -f1); else echo $f=none; fi; done; echo size=$(df -B1 --output=size /data | tail -1 | tr -d ' ')`

// snapshotScenario: a pod writes data; a VolumeSnapshot of its claim
// becomes readyToUse; the pod writes more; a claim restored from the
// snapshot, larger than the source, holds the data as of the snapshot
// in the larger filesystem; a claim cloned from the source holds the
// current data; the source, the snapshots, the restores and the clone
// are deleted in orders where each outlives what it came from, and each
// reads back whole after its origin is gone; nothing is left on the
// storage node.
func (s *suite) snapshotScenario(dataDir string) {
	t := s.t
	s.apply(pvc("origin", "mpnbd-ext4", "1Gi", false))
	var before map[string]string
	s.step("snapshots: write, snapshot, write more", func() {
		s.startPod("origin-app", pod("origin-app", "origin", `head -c 48M /dev/urandom > /data/a && sync && touch /tmp/written && sleep 3600`, false))
		s.waitFor("the first file written", 2*time.Minute, func() string {
			out, err := s.c.Kubectl(s.ctx, "exec", "origin-app", "--", "sh", "-c", `[ -e /tmp/written ] || echo busy; `+sums)
			if err != nil || strings.Contains(out, "busy") || field(out, "a") == "none" {
				return fmt.Sprintf("%v: %s", err, out)
			}
			before = fieldsOf(out, "a", "b", "size")
			return ""
		})
		// The filesystem's own flush, as an application's would be: the
		// snapshot holds what was written and synced before it.
		s.kubectl("exec", "origin-app", "--", "sync")
		start := time.Now()
		s.apply(volumeSnapshot("origin-snap", "origin"))
		handle := s.waitSnapshotReady("origin-snap")
		t.Logf("VolumeSnapshot of a 1 GiB volume in use (48 MiB written) ready in %v", time.Since(start).Round(10*time.Millisecond))
		method := s.jsonpath("{.status.method}", "get", "nbdsnapshot", handle)
		used := s.jsonpath("{.status.usedBytes}", "get", "nbdsnapshot", handle)
		held := s.jsonpath("{.status.heldMilliseconds}", "get", "nbdsnapshot", handle)
		if held == "" {
			held = "0" // under a millisecond: the field is omitted
		}
		if method != "reflink" && method != "copy" {
			t.Fatalf("NBDSnapshot %s: method %q", handle, method)
		}
		t.Logf("NBDSnapshot %s: method %s, uses %s bytes, held the source's writes %s ms", handle, method, used, held)
		if f := filepath.Join(dataDir, handle+".snap"); !exists(f) {
			t.Fatalf("the snapshot's file %s is not on the storage node", f)
		}
		// More writes after the snapshot: a new file, the old one changed.
		s.kubectl("exec", "origin-app", "--", "sh", "-c", `head -c 16M /dev/urandom >> /data/a && head -c 16M /dev/urandom > /data/b && sync`)
	})
	after := fieldsOf(s.kubectl("exec", "origin-app", "--", "sh", "-c", sums), "a", "b", "size")
	if after["a"] == before["a"] || after["b"] == "none" {
		t.Fatalf("the writes after the snapshot changed nothing: before %v, after %v", before, after)
	}

	check := func(what, claim string, want map[string]string, minSize int64) {
		t.Helper()
		out := s.runPod(claim+"-reader", pod(claim+"-reader", claim, sums, false))
		got := fieldsOf(out, "a", "b", "size")
		if got["a"] != want["a"] || got["b"] != want["b"] {
			t.Fatalf("%s: files a=%s b=%s, want a=%s b=%s", what, got["a"], got["b"], want["a"], want["b"])
		}
		if n, _ := strconv.ParseInt(got["size"], 10, 64); n < minSize {
			t.Fatalf("%s: filesystem of %s bytes, want at least %d", what, got["size"], minSize)
		}
	}
	s.step("snapshots: restore, larger than the source", func() {
		s.apply(pvcFrom("restored", "mpnbd-ext4", "2Gi", "VolumeSnapshot", "origin-snap"))
		// The filesystem grew to the claim at its first mount.
		check("the restore", "restored", before, 1900<<20)
		if c := s.jsonpath("{.status.capacity.storage}", "get", "pvc", "restored"); c != "2Gi" {
			t.Fatalf("restored claim's capacity %s, want 2Gi", c)
		}
	})
	s.step("snapshots: clone of the claim in use", func() {
		s.kubectl("exec", "origin-app", "--", "sync")
		s.apply(pvcFrom("cloned", "mpnbd-ext4", "1Gi", "PersistentVolumeClaim", "origin"))
		check("the clone", "cloned", after, 900<<20)
	})

	s.step("snapshots: delete in any order", func() {
		// The source goes first: its snapshot and its restore and clone
		// keep their data.
		origin := s.jsonpath("{.spec.volumeName}", "get", "pvc", "origin")
		s.kubectl("delete", "pod", "origin-app", "--wait=true", "--timeout=120s")
		s.kubectl("delete", "pvc", "origin", "--wait=true", "--timeout=180s")
		s.waitFor("the source's volume and backing file gone", 3*time.Minute, func() string {
			if v := s.jsonpath("{.metadata.name}", "get", "nbdvol", origin); v != "" {
				return "NBDVolume " + v + " left"
			}
			if f := filepath.Join(dataDir, origin+".img"); exists(f) {
				return "backing file " + f + " left"
			}
			return ""
		})
		if snaps, _ := filepath.Glob(filepath.Join(dataDir, "*.snap")); len(snaps) != 1 {
			t.Fatalf("snapshot files after the source's deletion: %v, want the one snapshot's", snaps)
		}
		check("the restore after its source's deletion", "restored", before, 1900<<20)
		// A snapshot of the clone, restored; then the snapshot goes
		// before its restore, which keeps its data.
		s.apply(volumeSnapshot("clone-snap", "cloned"))
		s.waitSnapshotReady("clone-snap")
		s.apply(pvcFrom("restored2", "mpnbd-ext4", "1Gi", "VolumeSnapshot", "clone-snap"))
		check("the clone's snapshot restored", "restored2", after, 900<<20)
		s.kubectl("delete", "volumesnapshot", "clone-snap", "origin-snap", "--wait=true", "--timeout=120s")
		check("a restore after its snapshot's deletion", "restored2", after, 900<<20)
		check("the clone after its snapshot's deletion", "cloned", after, 900<<20)
		s.kubectl("delete", "pvc", "restored", "restored2", "cloned", "--wait=true", "--timeout=180s")
		s.waitFor("no snapshot or volume of the scenario left", 3*time.Minute, func() string {
			if v := s.jsonpath("{.items[*].metadata.name}", "get", "volumesnapshotcontents"); v != "" {
				return "VolumeSnapshotContents left: " + v
			}
			if v := s.jsonpath("{.items[*].metadata.name}", "get", "nbdsnapshots"); v != "" {
				return "NBDSnapshots left: " + v
			}
			files, _ := filepath.Glob(filepath.Join(dataDir, "*.snap"))
			if len(files) > 0 {
				return fmt.Sprintf("snapshot files left: %v", files)
			}
			for _, claim := range []string{"origin", "restored", "restored2", "cloned"} {
				if s.jsonpath("{.metadata.name}", "get", "pvc", claim) != "" {
					return "claim left: " + claim
				}
			}
			return ""
		})
	})
}

// fieldsOf picks key=value lines of out.
func fieldsOf(out string, keys ...string) map[string]string {
	m := map[string]string{}
	for _, k := range keys {
		m[k] = field(out, k)
	}
	return m
}

func exists(path string) bool {
	_, err := os.Stat(path)
	return err == nil
}
