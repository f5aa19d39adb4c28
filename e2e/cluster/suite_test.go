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
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/mpnbd/mpnbd/internal/testenv/repo"
	"github.com/mpnbd/mpnbd/internal/testenv/topo"
	"github.com/mpnbd/mpnbd/pkg/mptcp"
)

// The suite's topology: the storage agent's pod network namespace is
// reached from the node (the host) over paths 10.77.<i>.0/24, host side
// .1, agent side .2, each shaped to 1 Gbit/s in both directions.
const (
	paths       = 4
	rateMbit    = 1000
	driverImage = "mpnbd.local/mpnbd:e2e"
	namespace   = "storage"
	// nodeMetricsPort is the node plugin's metrics port (host network).
	nodeMetricsPort = 19811
	// controllerMetricsPort is the controller's (the chart's default; on
	// the host network in the suite), agentMetricsPort the storage
	// agent's (the chart's default, in a pod network).
	controllerMetricsPort = 9818
	agentMetricsPort      = 9810
)

func pathAddr(i int, host bool) string {
	if host {
		return fmt.Sprintf("10.77.%d.1", i)
	}
	return fmt.Sprintf("10.77.%d.2", i)
}

// suite is the state of one run.
type suite struct {
	t       *testing.T
	c       *Cluster
	dir     string
	ctx     context.Context
	timings []timing
	helmBin string
	// values is the values file of the release.
	values string
	// previousChart is the previous release's packaged chart, installed
	// first and then upgraded from.
	previousChart string
	// chart is this tree's chart as a release packages it (releaseChart),
	// which the upgrade and the template install use.
	chart string
	// cliBuilt is mpnbdctl's path once built (cli_test.go).
	cliBuilt string
	// snapshotterImage is the csi-snapshotter's image, which the
	// previous chart does not know: the upgrade sets it.
	snapshotterImage string
	// nodeIP is nodeHTTPHost's answer, once asked.
	nodeIP string
}

type timing struct {
	what string
	d    time.Duration
	// failed: the test failed during this step (its message is where
	// the step's lines are, above).
	failed bool
}

func (s *suite) step(what string, fn func()) {
	s.t.Helper()
	start, failedBefore := time.Now(), s.t.Failed()
	// Deferred: also when fn fails the test and ends it, so that the
	// summary names the step.
	defer func() {
		d := time.Since(start).Round(10 * time.Millisecond)
		s.timings = append(s.timings, timing{what, d, s.t.Failed() && !failedBefore})
		s.t.Logf("step %q took %v", what, d)
	}()
	fn()
}

// suiteTools are what the driver suites need built (cached): helm, the
// Debian rootfs of the fio image, the CSI sidecars.
func suiteTools(t *testing.T) (helm, rootfs, sidecars string) {
	return cachedTool(t, "tools.sh", "HELM"), cachedTool(t, "rootfs.sh", "ROOTFS"), cachedTool(t, "sidecars.sh", "SIDECARS")
}

// cachedTool runs a hack/ script that prints NAME=path and returns path.
func cachedTool(t *testing.T, script, key string) string {
	t.Helper()
	root, err := repo.Root()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("bash", filepath.Join(root, "hack", script))
	cmd.Stderr = os.Stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("hack/%s: %v", script, err)
	}
	for _, l := range strings.Split(string(out), "\n") {
		if v, ok := strings.CutPrefix(l, key+"="); ok {
			return v
		}
	}
	t.Fatalf("hack/%s printed no %s=", script, key)
	return ""
}

func (s *suite) kubectl(args ...string) string {
	s.t.Helper()
	out, err := s.c.Kubectl(s.ctx, args...)
	if err != nil {
		s.t.Fatal(err)
	}
	return out
}

func (s *suite) apply(manifest string) {
	s.t.Helper()
	if out, err := kubectlStdin(s.ctx, s.c, manifest, "apply", "-f", "-"); err != nil {
		s.t.Fatalf("apply: %v: %s\n%s", err, out, manifest)
	}
}

// waitFor polls cond (which returns "" when satisfied) for up to timeout.
func (s *suite) waitFor(what string, timeout time.Duration, cond func() string) {
	s.t.Helper()
	end := time.Now().Add(timeout)
	for {
		msg := cond()
		if msg == "" {
			return
		}
		if time.Now().After(end) {
			s.dumpState()
			s.t.Fatalf("waiting for %s: %s", what, msg)
		}
		time.Sleep(500 * time.Millisecond)
	}
}

// dumpState logs what helps to understand a failure.
func (s *suite) dumpState() {
	for _, args := range [][]string{
		{"get", "pods", "-A", "-o", "wide"},
		{"get", "pvc,pv,volumeattachments", "-A"},
		{"get", "nbdvolumes,nbdstoragenodes,nbdsnapshots", "-o", "yaml"},
		{"get", "volumesnapshots,volumesnapshotcontents", "-A", "-o", "yaml"},
		{"get", "events", "-A", "--sort-by=.lastTimestamp"},
	} {
		out, _ := s.c.Kubectl(context.Background(), args...)
		s.t.Logf("kubectl %s:\n%s", strings.Join(args, " "), out)
	}
	for _, c := range []string{"controller", "csi-provisioner", "csi-attacher", "csi-resizer", "csi-snapshotter"} {
		out, _ := s.c.Kubectl(context.Background(), "logs", "-n", namespace, "deploy/mpnbd-controller", "-c", c, "--tail=40")
		s.t.Logf("logs %s:\n%s", c, out)
	}
	for _, ds := range []string{"mpnbd-node", "mpnbd-storage-agent"} {
		out, _ := s.c.Kubectl(context.Background(), "logs", "-n", namespace, "ds/"+ds, "--all-containers", "--tail=40")
		s.t.Logf("logs %s:\n%s", ds, out)
	}
	out, _ := s.c.Kubectl(context.Background(), "logs", "-n", "kube-system", "deploy/snapshot-controller", "--tail=40")
	s.t.Logf("logs snapshot-controller:\n%s", out)
	s.t.Logf("kubelet:\n%s", s.c.LogTail("kubelet", 40))
}

// nodeHTTPHost is where the node plugin's pod serves HTTP (its metrics,
// the registrar's and the livenessprobe's /healthz), as a scraper or the
// kubelet reaches it: the node's first InternalIP, the pod IP of a pod on
// the host network, to which the chart binds them (httpAddressFrom); not
// 127.0.0.1.
func (s *suite) nodeHTTPHost() string {
	s.t.Helper()
	if s.nodeIP == "" {
		ips := strings.Fields(s.jsonpath(`{.status.addresses[?(@.type=="InternalIP")].address}`, "get", "node", s.c.NodeName))
		if len(ips) == 0 {
			s.t.Fatalf("node %s has no InternalIP", s.c.NodeName)
		}
		s.nodeIP = ips[0]
	}
	return s.nodeIP
}

// nodeMetricsURL is the node plugin's /metrics.
func (s *suite) nodeMetricsURL() string {
	return "http://" + net.JoinHostPort(s.nodeHTTPHost(), strconv.Itoa(nodeMetricsPort)) + "/metrics"
}

func (s *suite) jsonpath(path string, args ...string) string {
	s.t.Helper()
	out, err := s.c.Kubectl(s.ctx, append(args, "-o", "jsonpath="+path)...)
	if err != nil {
		return ""
	}
	return strings.TrimSpace(out)
}

// TestDriverOnCluster installs the driver with its Helm chart on a real
// single-node cluster and uses it as a user would: Filesystem and Block
// PVCs through pods, data surviving a pod's replacement, online
// expansion, snapshots, restores and clones, deletion leaving nothing behind, one volume using the
// four MPTCP paths to the storage agent, and the CSI sidecars' metrics and
// health endpoints answering.
func TestDriverOnCluster(t *testing.T) {
	requireCluster(t)
	helm, rootfs, sidecars := suiteTools(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Minute)
	defer cancel()
	prev, err := previousChart()
	if err != nil {
		t.Fatal(err)
	}
	s := &suite{t: t, dir: t.TempDir(), ctx: ctx, helmBin: helm, previousChart: prev}
	if s.chart, err = releaseChart(ctx, filepath.Join(s.dir, "release")); err != nil {
		t.Fatal(err)
	}
	before := hostState(t)
	defer s.summary(before)

	// The driver's image builds from its Dockerfile, as users build it
	// (hack/image.sh: buildah), while the cluster comes up. Its version is
	// one no earlier build had, which the driver's pods must log.
	imageVersion, driverBuilt := s.buildDriverImage()
	restoreMPTCP := hostMPTCPLimits(t, paths-1)
	defer restoreMPTCP()

	s.step("cluster up", func() {
		c, err := Up(ctx, Config{Dir: filepath.Join(s.dir, "cluster"), KubeBin: KubeBin(), Log: testLog{t}})
		if err != nil {
			t.Fatalf("up: %v", err)
		}
		s.c = c
	})
	defer s.down()

	sidecarImages := s.importImages(driverBuilt, rootfs, sidecars)
	s.snapshotterImage = sidecarImages["csi-snapshotter"]
	s.installSnapshotAPI(sidecars, PodGateway, "")
	s.kubectl("label", "node", s.c.NodeName, "mpnbd.io/storage-node=true")
	dataDir := filepath.Join(s.dir, "volumes")
	s.step("helm install", func() {
		var storageAddrs []string
		for i := 1; i <= paths; i++ {
			storageAddrs = append(storageAddrs, pathAddr(i, false))
		}
		values := valuesHead(sidecarImages, PodGateway) + fmt.Sprintf(`controller: {hostNetwork: true}
node:
  kubeletDir: %s
  stateDir: %s
  transports: [fuse]
  metricsPort: %d
  storageAddresses: [%s]
storageAgent:
  hostNetwork: false
  dataDir: %s
  storageAddressesFrom: ""
  storageAddresses: [%s]
  signalNICs: [%s]
`, s.c.KubeletRoot(), filepath.Join(s.dir, "node-state"), nodeMetricsPort,
			strings.Join(hostAddrs(), ","), dataDir, strings.Join(storageAddrs, ","), strings.Join(joinCIDRs(), ","))
		s.writeValues(values)
		vf := s.values
		// As a platform team installs it: the previous release (upgraded
		// to this chart under I/O by upgradeScenario) into a namespace of
		// its own that Helm creates (the cluster enforces no Pod Security
		// level).
		if out, err := s.helm("install", "mpnbd", s.previousChart, "--create-namespace", "--values", vf, "--wait=false"); err != nil {
			t.Fatalf("helm install %s: %v\n%s", filepath.Base(s.previousChart), err, out)
		}
		// The previous chart runs this release's image, whose
		// NBDVolumes have fields the previous CRD lacks (the API server
		// would drop a publication's token hash): this release's
		// NBDVolume CRD, which the upgrade applies with the chart anyway.
		// Only that one: a snapshot CRD would make the agent watch
		// snapshots, which the previous chart's RBAC does not allow.
		root, err := repo.Root()
		if err != nil {
			t.Fatal(err)
		}
		s.kubectl("apply", "-f", filepath.Join(root, "deploy", "crds", "mpnbd.io_nbdvolumes.yaml"))
	})

	s.step("storage paths to the agent", func() {
		s.waitFor("the storage agent's pod IP", 3*time.Minute, func() string {
			ip := s.jsonpath("{.items[0].status.podIP}", "get", "pods", "-n", namespace, "-l", "app.kubernetes.io/component=storage-agent")
			if ip == "" {
				return "no pod IP yet"
			}
			return ""
		})
		ip := s.jsonpath("{.items[0].status.podIP}", "get", "pods", "-n", namespace, "-l", "app.kubernetes.io/component=storage-agent")
		ns := netnsWithAddr(t, ip)
		addPaths(t, ns)
	})
	defer delPaths()

	s.step("driver ready", func() {
		s.waitDriverReady([]string{s.c.NodeName}, []string{s.c.NodeName})
	})

	s.step("the driver runs the image just built", func() {
		for _, w := range []string{"deploy/mpnbd-controller", "ds/mpnbd-node"} {
			s.waitFor(w+" logging version "+imageVersion, time.Minute, func() string {
				out, err := s.c.Kubectl(ctx, "logs", "-n", namespace, w, "--all-containers")
				if err != nil || !strings.Contains(out, imageVersion) {
					return fmt.Sprintf("%v: %s", err, lastLines([]byte(out), 5))
				}
				return ""
			})
		}
	})

	s.upgradeScenario()
	s.identityScenario(filepath.Join(s.dir, "node-state"))
	s.buildInfoScenario(imageVersion)
	if os.Getenv(envScaleOnly) != "" {
		// The scale scenario alone, on the driver of this chart with its
		// certificates issued (the scenario's volumes are encrypted).
		s.scaleScenario()
		s.uninstallScenario()
		return
	}
	if os.Getenv(envTokensOnly) != "" {
		// The token scenario alone, with the driver of this chart and
		// its admission policies.
		s.tokenScenario()
		s.uninstallScenario()
		return
	}
	s.encryptedScenario()
	s.filesystemScenario()
	s.tokenScenario()
	s.expandScenario()
	s.snapshotScenario(dataDir)
	s.sidecarEndpointsScenario()
	s.blockScenario()
	s.measureResources("after the upgrade, the filesystem, expansion, snapshot and block scenarios")
	s.scaleScenario()
	s.restartScenario()
	s.lostForGoodScenario(dataDir)
	s.uninstallRefusedScenario()
	s.deleteScenario(dataDir, filepath.Join(s.dir, "node-state"))
	s.uninstallScenario()
	s.templateInstallScenario()
}

// summary logs how long each step took and checks the host is as it was
// before the suite (deferred first: everything is undone by then).
func (s *suite) summary(before string) {
	t := s.t
	var failed []string
	for _, tm := range s.timings {
		mark := ""
		if tm.failed {
			mark, failed = "  FAILED", append(failed, strconv.Quote(tm.what))
		}
		t.Logf("%-40s %v%s", tm.what, tm.d, mark)
	}
	if len(failed) > 0 {
		// The last lines of a long log are the ones always read.
		t.Logf("failed in step(s) %s: search the log above for each step's name", strings.Join(failed, ", "))
	}
	if after := hostState(t); after != before {
		t.Errorf("the host changed:\nbefore: %s\nafter:  %s", before, after)
	}
}

// down takes the cluster down; after a failure it first shows the state
// and lets the driver release what it attached: pods first, then claims.
func (s *suite) down() {
	t := s.t
	if s.c == nil {
		return
	}
	if t.Failed() {
		s.dumpState()
		bg := context.Background()
		for _, args := range [][]string{
			{"delete", "pods", "--all", "-n", "default", "--timeout=90s"},
			{"delete", "pvc", "--all", "-n", "default", "--timeout=120s"},
		} {
			if _, err := s.c.Kubectl(bg, args...); err != nil {
				t.Logf("cleanup: kubectl %s: %v", strings.Join(args, " "), err)
			}
		}
	}
	if err := s.c.Down(); err != nil {
		t.Errorf("down: %v", err)
	}
}

// driverBuild is the driver's image being built.
type driverBuild struct {
	tar, log string
	done     chan error
}

// buildDriverImage starts building the driver's image from its
// Dockerfile, as users build it (hack/image.sh: buildah), at a version
// no earlier build had (which the driver's pods must log); it returns
// the version.
func (s *suite) buildDriverImage() (string, *driverBuild) {
	version := fmt.Sprintf("e2e-%d", time.Now().UnixNano())
	b := &driverBuild{tar: filepath.Join(s.dir, "mpnbd-image.tar"), log: filepath.Join(s.dir, "mpnbd-image-build.log"), done: make(chan error, 1)}
	go func() {
		f, err := os.Create(b.log)
		if err != nil {
			b.done <- err
			return
		}
		err = BuildDockerfileImage(s.ctx, driverImage, version, b.tar, f)
		f.Close()
		b.done <- err
	}()
	return version, b
}

// importImages waits for the driver's image and imports it into the
// cluster's nodes, with the fio image (the Debian rootfs and the host's
// fio) and the CSI sidecars' images (the controller's only into the
// nodes named in controllerNodes, when it names any); it returns the
// sidecars' references by name.
func (s *suite) importImages(b *driverBuild, rootfs, sidecars string, controllerNodes ...string) map[string]string {
	t := s.t
	sidecarImages := map[string]string{}
	s.step("build and import the images", func() {
		err := <-b.done
		build, _ := os.ReadFile(b.log)
		if err != nil {
			t.Fatalf("the driver's image: %v\n%s", err, lastLines(build, 60))
		}
		t.Logf("the driver's image: %s", lastLines(build, 1))
		began := time.Now()
		if err := s.c.ImportImage(s.ctx, b.tar); err != nil {
			t.Fatal(err)
		}
		t.Logf("the driver's image imported in %v", time.Since(began).Round(time.Millisecond))
		var images []Image
		fio, err := fioFiles()
		if err != nil {
			t.Fatal(err)
		}
		images = append(images, Image{Ref: fioImage, BaseLayers: []string{rootfs}, Files: fio})
		// The real csi-provisioner, csi-attacher, csi-resizer,
		// csi-snapshotter and snapshot-controller at the chart's versions;
		// stand-ins of the registrar and the livenessprobe
		// (hack/sidecars.sh).
		var controllers []Image
		for _, name := range []string{"csi-provisioner", "csi-attacher", "csi-resizer", "csi-snapshotter", "snapshot-controller", "csi-node-driver-registrar", "livenessprobe"} {
			ref := "mpnbd.local/" + name + ":e2e"
			sidecarImages[name] = ref
			im := Image{Ref: ref, Files: map[string]string{"/" + name: filepath.Join(sidecars, name)}, Entrypoint: []string{"/" + name}}
			if name == "csi-node-driver-registrar" || name == "livenessprobe" {
				images = append(images, im)
			} else {
				controllers = append(controllers, im)
			}
		}
		s.importBuilt(images)
		s.importBuilt(controllers, controllerNodes...)
	})
	return sidecarImages
}

// waitDriverReady waits for the storage nodes' capacity reports, the node
// plugin's registration on each node and the controller.
func (s *suite) waitDriverReady(storageNodes, nodes []string) {
	for _, n := range storageNodes {
		s.waitFor(n+"'s storage report", 3*time.Minute, func() string {
			a := s.jsonpath("{.status.availableBytes}", "get", "nbdstoragenode", n)
			if v, _ := strconv.ParseInt(a, 10, 64); v <= 0 {
				return "no capacity reported yet"
			}
			return ""
		})
	}
	for _, n := range nodes {
		s.waitFor("the node plugin's registration on "+n, 3*time.Minute, func() string {
			if d := s.jsonpath("{.spec.drivers[*].name}", "get", "csinode", n); !strings.Contains(d, "nbd.mptcp.mpnbd.io") {
				return "CSINode drivers: " + d
			}
			return ""
		})
	}
	s.waitFor("the controller", 3*time.Minute, func() string {
		if r := s.jsonpath("{.status.readyReplicas}", "get", "deploy", "-n", namespace, "mpnbd-controller"); r != "1" {
			return "ready replicas " + r
		}
		return ""
	})
}

// importBuilt builds each image's tarball and imports it into the nodes
// (those named in only, when it names any).
func (s *suite) importBuilt(images []Image, only ...string) {
	for _, im := range images {
		tarPath := filepath.Join(s.dir, strings.NewReplacer("/", "_", ":", "_").Replace(im.Ref)+".tar")
		began := time.Now()
		if err := im.Build(tarPath); err != nil {
			s.t.Fatal(err)
		}
		built := time.Now()
		if err := s.c.ImportImage(s.ctx, tarPath, only...); err != nil {
			s.t.Fatal(err)
		}
		s.t.Logf("image %s: built in %v, imported in %v", im.Ref, built.Sub(began).Round(time.Millisecond), time.Since(built).Round(time.Millisecond))
	}
}

// valuesHead is how the suites' chart values begin: the image just built
// and the sidecars' (imported, never pulled), the API server at apiHost,
// debug logs.
func valuesHead(sidecarImages map[string]string, apiHost string) string {
	return fmt.Sprintf(`image: {repository: mpnbd.local/mpnbd, tag: e2e, pullPolicy: Never}
sidecars:
  pullPolicy: Never
  provisioner: {image: %s}
  attacher: {image: %s}
  resizer: {image: %s}
  nodeDriverRegistrar: {image: %s}
  livenessProbe: {image: %s}
apiServer: {host: %q, port: "%d"}
logLevel: debug
`, sidecarImages["csi-provisioner"], sidecarImages["csi-attacher"], sidecarImages["csi-resizer"],
		sidecarImages["csi-node-driver-registrar"], sidecarImages["livenessprobe"], apiHost, APIServerPort)
}

// writeValues writes the release's values file.
func (s *suite) writeValues(values string) {
	vf := filepath.Join(s.dir, "values.yaml")
	if err := os.WriteFile(vf, []byte(values), 0o644); err != nil {
		s.t.Fatal(err)
	}
	s.values = vf
}

// waitEvent waits for an Event on the object named name whose reason or
// message holds what.
func (s *suite) waitEvent(name, what string) {
	s.t.Helper()
	s.waitFor("an event "+what+" for "+name, 2*time.Minute, func() string {
		ev := s.kubectl("get", "events", "--field-selector", "involvedObject.name="+name, "-o", "jsonpath={range .items[*]}{.reason}: {.message}{\"\\n\"}{end}")
		if !strings.Contains(ev, what) {
			return "events: " + ev
		}
		return ""
	})
}

// hostAddrs are the node's storage addresses.
func hostAddrs() []string {
	var a []string
	for i := 1; i <= paths; i++ {
		a = append(a, pathAddr(i, true))
	}
	return a
}

// joinCIDRs select the agent's addresses on paths 2..N: its signal
// endpoints (path 1 is the address clients dial).
func joinCIDRs() []string {
	var c []string
	for i := 2; i <= paths; i++ {
		c = append(c, fmt.Sprintf("10.77.%d.0/24", i))
	}
	return c
}

// netnsWithAddr finds the CNI network namespace holding ip.
func netnsWithAddr(t *testing.T, ip string) string {
	t.Helper()
	out, err := exec.Command("ip", "-o", "netns", "list").Output()
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(string(out), "\n") {
		f := strings.Fields(l)
		if len(f) == 0 || !strings.HasPrefix(f[0], "cni-") {
			continue
		}
		addrs, _ := exec.Command("ip", "-n", f[0], "-o", "addr").Output()
		if regexp.MustCompile(`inet ` + regexp.QuoteMeta(ip) + `/`).Match(addrs) {
			return f[0]
		}
	}
	t.Fatalf("no network namespace has %s", ip)
	return ""
}

func run(t *testing.T, name string, args ...string) {
	t.Helper()
	if out, err := exec.Command(name, args...).CombinedOutput(); err != nil {
		t.Fatalf("%s %s: %v: %s", name, strings.Join(args, " "), err, out)
	}
}

// addPaths joins the host and ns with the suite's veth pairs, shaped
// with tbf in both directions.
func addPaths(t *testing.T, ns string) {
	for i := 1; i <= paths; i++ {
		h, p := fmt.Sprintf("mpe2e%d", i), fmt.Sprintf("mpe2e%dp", i)
		run(t, "ip", "link", "add", h, "type", "veth", "peer", "name", p)
		run(t, "ip", "link", "set", p, "netns", ns)
		run(t, "ip", "addr", "add", pathAddr(i, true)+"/24", "dev", h)
		run(t, "ip", "-n", ns, "addr", "add", pathAddr(i, false)+"/24", "dev", p)
		run(t, "ip", "link", "set", h, "up")
		run(t, "ip", "-n", ns, "link", "set", p, "up")
		run(t, "tc", append([]string{"qdisc", "add", "dev", h, "root"}, topo.TBFArgs(rateMbit)...)...)
		run(t, "tc", append([]string{"-n", ns, "qdisc", "add", "dev", p, "root"}, topo.TBFArgs(rateMbit)...)...)
	}
}

// delPaths removes the host ends (and with them the pairs).
func delPaths() {
	for i := 1; i <= paths; i++ {
		_ = exec.Command("ip", "link", "del", fmt.Sprintf("mpe2e%d", i)).Run() // absent after a failed setup
	}
}

// hostMPTCPLimits lets the host's connections accept n announced
// addresses and open n additional subflows (the client side of the
// suite's topology has no endpoints of its own); the returned function
// restores the limits.
func hostMPTCPLimits(t *testing.T, n int) func() {
	t.Helper()
	pm, err := mptcp.DialPM()
	if err != nil {
		t.Fatalf("MPTCP path manager: %v", err)
	}
	old, err := pm.Limits()
	if err != nil {
		pm.Close()
		t.Fatal(err)
	}
	want := mptcp.Limits{Subflows: max(uint32(n), old.Subflows), AddAddrAccepted: max(uint32(n), old.AddAddrAccepted)}
	if err := pm.SetLimits(want); err != nil {
		pm.Close()
		t.Fatal(err)
	}
	return func() {
		if err := pm.SetLimits(old); err != nil {
			t.Errorf("restore the host's MPTCP limits: %v", err)
		}
		pm.Close()
	}
}
