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
	"encoding/json"
	"fmt"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/mpnbd/mpnbd/internal/testenv/repo"
)

// upgradedImageTag is the driver image's tag after the upgrade: the same
// image under another tag, so that the upgrade replaces every pod of the
// driver, as a release's new image does.
const upgradedImageTag = "e2e-next"

// previousChart is the packaged chart of the previous release
// (testdata/mpnbd-<version>.tgz), which the suite installs and then
// upgrades from.
func previousChart() (string, error) {
	root, err := repo.Root()
	if err != nil {
		return "", err
	}
	m, err := filepath.Glob(filepath.Join(root, "e2e", "cluster", "testdata", "mpnbd-*.tgz"))
	if err != nil || len(m) != 1 {
		return "", fmt.Errorf("want one e2e/cluster/testdata/mpnbd-*.tgz (the previous release's chart), found %v (%v)", m, err)
	}
	return m[0], nil
}

// releaseChart packages this tree's chart as make release does
// (hack/release.sh --chart-only: the chart's version, signed), into dir,
// and returns the package, which the suite upgrades to and renders.
func releaseChart(ctx context.Context, dir string) (string, error) {
	root, err := repo.Root()
	if err != nil {
		return "", err
	}
	cmd := exec.CommandContext(ctx, "bash", filepath.Join(root, "hack", "release.sh"), "--chart-only", "--out", dir)
	if out, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("hack/release.sh --chart-only: %w\n%s", err, out)
	}
	m, err := filepath.Glob(filepath.Join(dir, "mpnbd-*.tgz"))
	if err != nil || len(m) != 1 {
		return "", fmt.Errorf("want one mpnbd-*.tgz from hack/release.sh in %s, found %v (%v)", dir, m, err)
	}
	return m[0], nil
}

// helm runs helm on the suite's cluster, in the driver's namespace.
func (s *suite) helm(args ...string) (string, error) {
	cmd := exec.CommandContext(s.ctx, s.helmBin, append(args, "--namespace", namespace, "--kubeconfig", s.c.Kubeconfig)...)
	out, err := cmd.CombinedOutput()
	return string(out), err
}

// upgradeScenario: helm upgrade from the previous release's chart (which
// the suite installed) to this one, with a new image tag, while a pod runs
// fio --verify on a volume. Every pod of the driver is replaced: the
// controller, the node plugin, the datapath (a surge in which the new pod
// takes the volume over) and the storage agent (whose restart the volume's
// NBD session rides out); fio runs before, throughout and after, and no
// round sees an I/O error or a verify failure.
func (s *suite) upgradeScenario() {
	t := s.t
	s.apply(pvc("upgrade", "mpnbd-block", "256Mi", true))
	s.startPod("upgrade-fio", fioPod("upgrade-fio", "upgrade", 15*time.Minute))
	id := s.jsonpath("{.spec.volumeName}", "get", "pvc", "upgrade")
	before := map[string]string{}
	for _, c := range []string{"controller", "node", "datapath", "storage-agent"} {
		before[c] = s.jsonpath("{.items[*].metadata.name}", "get", "pods", "-n", namespace, "-l", "app.kubernetes.io/component="+c)
	}
	time.Sleep(10 * time.Second)
	s.step("upgrade: helm upgrade to this chart mid-fio", func() {
		if err := s.c.TagImage(s.ctx, driverImage, "mpnbd.local/mpnbd:"+upgradedImageTag); err != nil {
			t.Fatal(err)
		}
		if out, err := s.helm("upgrade", "mpnbd", s.chart, "--values", s.values,
			"--set", "image.tag="+upgradedImageTag, "--set", "sidecars.snapshotter.image="+s.snapshotterImage, "--wait=false"); err != nil {
			t.Fatalf("helm upgrade: %v\n%s", err, out)
		}
		// The new storage agent's pod network namespace needs the suite's
		// storage paths at once: until then the volume has no path to it.
		s.followStorageAgent(before["storage-agent"])
		for _, w := range []string{"daemonset/mpnbd-storage-agent", "daemonset/mpnbd-node", "daemonset/mpnbd-datapath", "deployment/mpnbd-controller"} {
			s.kubectl("rollout", "status", w, "-n", namespace, "--timeout=4m")
		}
	})
	s.step("upgrade: every pod replaced, running the new image", func() {
		for c, old := range before {
			s.waitFor("the old "+c+" pods to go", 2*time.Minute, func() string {
				now := s.jsonpath("{.items[*].metadata.name}", "get", "pods", "-n", namespace, "-l", "app.kubernetes.io/component="+c)
				for _, p := range strings.Fields(old) {
					if strings.Contains(now, p) {
						return c + " pods " + now + " still include " + p
					}
				}
				return ""
			})
			images := s.jsonpath("{.items[*].spec.containers[*].image}", "get", "pods", "-n", namespace, "-l", "app.kubernetes.io/component="+c)
			if !strings.Contains(images, "mpnbd.local/mpnbd:"+upgradedImageTag) {
				t.Errorf("%s pods run %s, want the upgraded image", c, images)
			}
		}
		out, err := s.helm("history", "mpnbd", "--max", "1")
		if err != nil || !strings.Contains(out, "deployed") || !strings.Contains(out, "Upgrade complete") {
			t.Errorf("helm history after the upgrade: %v\n%s", err, out)
		}
		logs := s.kubectl("logs", "-n", namespace, "-l", "app.kubernetes.io/component=datapath", "--tail=-1")
		if !takenOver(logs, id) {
			t.Errorf("the upgraded datapath did not take the volume over:\n%s", logs)
		}
		s.waitHealthy(id)
		// What on-call reads: the storage node Ready and the volume
		// Reachable, in kubectl get's columns (the upgraded controller
		// keeps them).
		s.waitFor("the storage node Ready and the volume Reachable", time.Minute, func() string {
			nodes := s.kubectl("get", "nbdnode", s.c.NodeName)
			vols := s.kubectl("get", "nbdvol", id)
			if !strings.Contains(firstLine(nodes), "READY") || !strings.Contains(nodes, "True") {
				return "kubectl get nbdnode:\n" + nodes
			}
			if !strings.Contains(firstLine(vols), "REACHABLE") || !strings.Contains(vols, "True") {
				return "kubectl get nbdvol:\n" + vols
			}
			return ""
		})
		// I/O went on throughout: fio is still writing and verifying.
		if p := s.jsonpath("{.status.phase}", "get", "pod", "upgrade-fio"); p != "Running" {
			t.Fatalf("fio pod is %s after the upgrade, want it still running (its time is too short for the upgrade)", p)
		}
	})
	s.step("upgrade: fio finishes, every block verified", func() {
		rounds := s.fioRounds("upgrade-fio", s.stopFio("upgrade-fio", 2))
		t.Logf("fio across helm upgrade from %s: %s verified rounds, 0 errors", filepath.Base(s.previousChart), rounds)
		s.kubectl("delete", "pod", "upgrade-fio", "--wait=true", "--timeout=120s")
		s.kubectl("delete", "pvc", "upgrade", "--wait=true", "--timeout=120s")
	})
}

// uninstallRefusedScenario: helm uninstall while volumes exist fails, its
// hook's log names every volume, and the driver stays installed and
// serving.
func (s *suite) uninstallRefusedScenario() {
	t := s.t
	s.step("uninstall refused while volumes exist", func() {
		vols := strings.Fields(s.jsonpath("{.items[*].metadata.name}", "get", "nbdvolumes"))
		if len(vols) == 0 {
			t.Fatal("no volume exists to refuse the uninstall for")
		}
		out, err := s.helm("uninstall", "mpnbd", "--wait", "--timeout=3m")
		if err == nil {
			t.Fatalf("helm uninstall with %d volumes succeeded:\n%s", len(vols), out)
		}
		if !strings.Contains(out, "mpnbd-uninstall-check") {
			t.Errorf("helm uninstall failed, but not in its pre-delete hook (Job mpnbd-uninstall-check):\n%s", out)
		}
		log := s.kubectl("logs", "-n", namespace, "job/mpnbd-uninstall-check")
		// A volume whose claim an earlier scenario deleted may go
		// between the listing above and the check's own: only those
		// still there after it must be named.
		after := strings.Fields(s.jsonpath("{.items[*].metadata.name}", "get", "nbdvolumes"))
		for _, v := range vols {
			switch {
			case strings.Contains(log, v):
			case !slices.Contains(after, v):
				t.Logf("volume %s went while the uninstall was refused; the check's log need not name it", v)
			default:
				t.Errorf("the uninstall check's log does not name volume %s:\n%s", v, log)
			}
		}
		// Helm leaves a release whose pre-delete hook failed in
		// "uninstalling"; a rollback to its own revision, as the chart's
		// README says, makes it deployed again (helm upgrade needs that).
		var st struct {
			Version int `json:"version"`
			Info    struct {
				Status string `json:"status"`
			} `json:"info"`
		}
		if out, err := s.helm("status", "mpnbd", "-o", "json"); err != nil || json.Unmarshal([]byte(out), &st) != nil {
			t.Fatalf("helm status after the refused uninstall: %v\n%s", err, out)
		}
		if st.Info.Status != "uninstalling" && st.Info.Status != "deployed" {
			t.Errorf("release status after the refused uninstall: %q", st.Info.Status)
		}
		if st.Info.Status == "uninstalling" {
			if out, err := s.helm("rollback", "mpnbd", strconv.Itoa(st.Version), "--wait", "--timeout=3m"); err != nil {
				t.Fatalf("helm rollback to revision %d after the refused uninstall: %v\n%s", st.Version, err, out)
			}
			if out, err := s.helm("status", "mpnbd"); err != nil || !strings.Contains(out, "STATUS: deployed") {
				t.Errorf("after the rollback: %v\n%s", err, out)
			}
		}
		// Bounded, not at once: the earlier scenarios restarted the
		// node plugin, and on a loaded machine a pod may still be
		// getting ready.
		s.waitFor("the node plugin ready after the refused uninstall", time.Minute, func() string {
			if r := s.jsonpath("{.status.numberReady}", "get", "daemonset", "mpnbd-node", "-n", namespace); r != "1" {
				return fmt.Sprintf("%q node plugin pods ready", r)
			}
			return ""
		})
	})
}

// uninstallScenario: with no volume left, helm uninstall succeeds and
// leaves nothing of the release in its namespace; the CRDs stay (kept).
func (s *suite) uninstallScenario() {
	t := s.t
	s.step("uninstall", func() {
		if out, err := s.helm("uninstall", "mpnbd", "--wait", "--timeout=3m"); err != nil {
			t.Fatalf("helm uninstall with no volumes: %v\n%s", err, out)
		}
		s.waitFor("the release's objects gone", 2*time.Minute, func() string {
			if left := s.jsonpath("{.items[*].metadata.name}", "get", "pods,jobs,daemonsets,deployments,serviceaccounts,roles",
				"-n", namespace, "-l", "app.kubernetes.io/instance=mpnbd"); left != "" {
				return "left in " + namespace + ": " + left
			}
			if left := s.jsonpath("{.items[*].metadata.name}", "get", "csidriver,clusterroles,clusterrolebindings,storageclasses",
				"-l", "app.kubernetes.io/instance=mpnbd"); left != "" {
				return "cluster-scoped objects left: " + left
			}
			return ""
		})
		for _, crd := range []string{"nbdvolumes.mpnbd.io", "nbdstoragenodes.mpnbd.io", "nbdsnapshots.mpnbd.io"} {
			if _, err := s.c.Kubectl(s.ctx, "get", "crd", crd); err != nil {
				t.Errorf("CRD %s was removed by helm uninstall; it is to be kept: %v", crd, err)
			}
		}
	})
}

// templateInstallScenario: the chart rendered without a cluster (helm
// template, as Argo CD and Flux render it) and applied with kubectl apply
// --server-side, after the release was uninstalled: the driver comes up
// and a claim of the chart's ext4 class (whose volumes get the
// controller's default encryption) is written and read back by two pods.
func (s *suite) templateInstallScenario() {
	t := s.t
	s.step("template install: helm template | kubectl apply --server-side", func() {
		// As Argo CD and Flux render it: the cluster's version given, no
		// access to the cluster.
		var version struct {
			ServerVersion struct {
				GitVersion string `json:"gitVersion"`
			} `json:"serverVersion"`
		}
		if err := json.Unmarshal([]byte(s.kubectl("version", "-o", "json")), &version); err != nil || version.ServerVersion.GitVersion == "" {
			t.Fatalf("the cluster's version: %v", err)
		}
		cmd := exec.CommandContext(s.ctx, s.helmBin, "template", "mpnbd", s.chart,
			"--namespace", namespace, "--kube-version", version.ServerVersion.GitVersion, "--values", s.values,
			"--set", "image.tag="+upgradedImageTag, "--set", "sidecars.snapshotter.image="+s.snapshotterImage, "--no-hooks")
		var stderr strings.Builder
		cmd.Stderr = &stderr
		out, err := cmd.Output()
		if err != nil {
			t.Fatalf("helm template: %v\n%s", err, stderr.String())
		}
		if strings.Contains(string(out), "helm.sh/hook") {
			t.Fatal("helm template --no-hooks rendered a hook")
		}
		// The CRDs and the CA are what the uninstalled release kept: the
		// apply takes their fields over.
		if out, err := kubectlStdin(s.ctx, s.c, string(out), "apply", "--server-side", "--force-conflicts", "--field-manager=gitops", "-f", "-"); err != nil {
			t.Fatalf("kubectl apply --server-side: %v\n%s", err, out)
		}
		s.followStorageAgent("")
		for _, w := range []string{"daemonset/mpnbd-storage-agent", "daemonset/mpnbd-node", "daemonset/mpnbd-datapath", "deployment/mpnbd-controller"} {
			s.kubectl("rollout", "status", w, "-n", namespace, "--timeout=4m")
		}
	})
	s.apply(pvc("tmpl", "mpnbd-ext4", "256Mi", false))
	s.writeReadBack("template install", "tmpl")
	s.step("template install: the volume encrypted by the controller's default, then deleted", func() {
		pv := s.jsonpath("{.spec.volumeName}", "get", "pvc", "tmpl")
		if enc := s.jsonpath("{.spec.encryption}", "get", "nbdvolume", pv); enc != "required" {
			t.Errorf("NBDVolume %s of a class naming no encryption: spec.encryption %q, want the default (required)", pv, enc)
		}
		s.kubectl("delete", "pvc", "tmpl", "--wait=true", "--timeout=180s")
		s.waitFor("the volume "+pv+" gone", 3*time.Minute, func() string {
			if v := s.jsonpath("{.metadata.name}", "get", "pv", pv, "--ignore-not-found"); v != "" {
				return "PV left"
			}
			return ""
		})
	})
}

// followStorageAgent waits for the storage agent's pod old to be replaced
// and gives the new pod's network namespace the suite's storage paths.
func (s *suite) followStorageAgent(old string) {
	s.waitFor("a new storage agent pod with an IP", 3*time.Minute, func() string {
		name := s.jsonpath("{.items[0].metadata.name}", "get", "pods", "-n", namespace, "-l", "app.kubernetes.io/component=storage-agent")
		ip := s.jsonpath("{.items[0].status.podIP}", "get", "pods", "-n", namespace, "-l", "app.kubernetes.io/component=storage-agent")
		if name == old || ip == "" {
			return "no new pod IP yet"
		}
		return ""
	})
	delPaths()
	addPaths(s.t, netnsWithAddr(s.t, s.jsonpath("{.items[0].status.podIP}", "get", "pods", "-n", namespace, "-l", "app.kubernetes.io/component=storage-agent")))
}

// fioRounds is the verified rounds in a fioPod's output; none fails the
// test with the output.
func (s *suite) fioRounds(name, out string) string {
	s.t.Helper()
	rounds := field(out, "rounds")
	if rounds == "" || rounds == "0" {
		s.t.Fatalf("fio pod %s output %q", name, out)
	}
	return rounds
}

// firstLine is the first line of s.
func firstLine(s string) string {
	l, _, _ := strings.Cut(s, "\n")
	return l
}
