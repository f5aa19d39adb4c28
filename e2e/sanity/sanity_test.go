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

// Package sanity runs csi-sanity against the real driver: the controller,
// storage agent and node plugin commands, built from this module and run
// as processes, a real API server (etcd + kube-apiserver), a real MPTCP
// NBD server, and real staging and publishing on this machine through the
// fuse transport (FUSE file + loop device + ext4).
package sanity

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/kubernetes-csi/csi-test/v5/pkg/sanity"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/mpnbd/mpnbd/api/v1alpha1"
	"github.com/mpnbd/mpnbd/internal/testenv/apiserver"
	"github.com/mpnbd/mpnbd/internal/testenv/repo"
	"github.com/mpnbd/mpnbd/pkg/access"
	"github.com/mpnbd/mpnbd/pkg/driver"
)

const (
	namespace   = "mpnbd-system"
	storageNode = "storage-1"
	nodeID      = "worker-1"
	maxVolumes  = 4

	// accessEnv selects the access type of a run: csi-sanity (Ginkgo)
	// runs once per process, so Block runs in a child process.
	accessEnv = "MPNBD_SANITY_ACCESS"
)

// cluster is the running driver.
type cluster struct {
	dir            string
	controllerSock string
	nodeSock       string
	client         client.Client
	// nodeToken is the node plugin's token (made by the test, in its
	// state directory, so that the Node can announce its hash).
	nodeToken string
}

func requireRoot(t *testing.T) {
	t.Helper()
	if runtime.GOOS != "linux" || os.Geteuid() != 0 {
		t.Skip("csi-sanity needs root on Linux (mounts, loop devices, FUSE, MPTCP)")
	}
	if _, err := os.Stat("/dev/fuse"); err != nil {
		t.Skipf("csi-sanity uses the fuse transport: %v", err)
	}
}

// buildCommands builds the driver's commands into dir.
func buildCommands(t *testing.T, dir string) {
	t.Helper()
	if err := repo.BuildCommands(dir); err != nil {
		t.Fatal(err)
	}
}

// start runs a command until the test ends; its output goes to a log file
// that is printed when the test fails.
func start(t *testing.T, dir, name string, args ...string) {
	t.Helper()
	logPath := filepath.Join(dir, name+".log")
	logf, err := os.Create(logPath)
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(filepath.Join(dir, name), args...)
	cmd.Stdout, cmd.Stderr = logf, logf
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() {
		cmd.Wait()
		close(done)
	}()
	t.Cleanup(func() {
		cmd.Process.Signal(os.Interrupt)
		select {
		case <-done:
		case <-time.After(30 * time.Second):
			cmd.Process.Kill()
			<-done
		}
		logf.Close()
		if t.Failed() || os.Getenv("MPNBD_SANITY_LOGS") == "1" {
			b, _ := os.ReadFile(logPath)
			t.Logf("--- %s log ---\n%s", name, tail(string(b), 200))
		}
	})
}

func tail(s string, lines int) string {
	l := strings.Split(s, "\n")
	if len(l) > lines {
		l = l[len(l)-lines:]
	}
	return strings.Join(l, "\n")
}

func waitFor(t *testing.T, what string, timeout time.Duration, ok func() error) {
	t.Helper()
	end := time.Now().Add(timeout)
	for {
		err := ok()
		if err == nil {
			return
		}
		if time.Now().After(end) {
			t.Fatalf("waiting for %s: %v", what, err)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// startCluster brings up the API server, the storage agent, the
// controller and the node plugin.
func startCluster(t *testing.T) *cluster {
	t.Helper()
	requireRoot(t)
	cfg, c := apiserver.Start(t)
	ctx := context.Background()
	dir := t.TempDir()
	buildCommands(t, dir)
	kubeconfig := apiserver.WriteKubeconfig(t, cfg)

	if err := c.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: namespace}}); err != nil {
		t.Fatal(err)
	}
	// The worker's Node object, as the kubelet would register it, with
	// the storage address and the hash of the token the node plugin
	// would publish (the plugin, without API access here, takes the
	// token from its state directory): exports are then served only to
	// connections from that address with that token.
	nodeToken, err := access.LoadOrCreateToken(filepath.Join(dir, "node-state", "token"))
	if err != nil {
		t.Fatal(err)
	}
	node := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: nodeID,
		Annotations: map[string]string{access.AnnotationStorageAddresses: "127.0.0.1", access.AnnotationTokenSHA256: access.TokenHash(nodeToken)}}}
	if err := c.Create(ctx, node); err != nil {
		t.Fatal(err)
	}
	// Its CSINode, as the kubelet registers it from NodeGetInfo: the
	// attach limit the controller enforces.
	limit := int32(maxVolumes)
	csiNode := &storagev1.CSINode{ObjectMeta: metav1.ObjectMeta{Name: nodeID},
		Spec: storagev1.CSINodeSpec{Drivers: []storagev1.CSINodeDriver{{
			Name: driver.DriverName, NodeID: nodeID, Allocatable: &storagev1.VolumeNodeResources{Count: &limit},
		}}}}
	if err := c.Create(ctx, csiNode); err != nil {
		t.Fatal(err)
	}

	cl := &cluster{
		dir:            dir,
		controllerSock: filepath.Join(dir, "controller.sock"),
		nodeSock:       filepath.Join(dir, "node.sock"),
		client:         c,
		nodeToken:      nodeToken,
	}
	start(t, dir, "nbd-server", "--cluster", "--node-name", storageNode, "--namespace", namespace,
		"--data-dir", filepath.Join(dir, "volumes"), "--storage-address", "127.0.0.1",
		"--listen", ":0", "--metrics-addr", "", "--heartbeat", "2s", "--kubeconfig", kubeconfig)
	start(t, dir, "controller", "--endpoint", "unix://"+cl.controllerSock, "--namespace", namespace,
		"--kubeconfig", kubeconfig, "--wait-timeout", "30s")
	start(t, dir, "node", "--endpoint", "unix://"+cl.nodeSock, "--node-id", nodeID,
		"--state-dir", filepath.Join(dir, "node-state"), "--transports", "fuse", "--max-volumes", fmt.Sprint(maxVolumes),
		"--storage-address", "127.0.0.1")

	waitFor(t, "the storage agent's report", time.Minute, func() error {
		sn := &v1alpha1.NBDStorageNode{}
		if err := c.Get(ctx, client.ObjectKey{Name: storageNode}, sn); err != nil {
			return err
		}
		if sn.Status.Port == 0 || sn.Status.AvailableBytes == 0 {
			return fmt.Errorf("status %+v", sn.Status)
		}
		return nil
	})
	for _, s := range []string{cl.controllerSock, cl.nodeSock} {
		waitFor(t, s, time.Minute, func() error { _, err := os.Stat(s); return err })
	}
	return cl
}

func (cl *cluster) config(accessType string) sanity.TestConfig {
	cfg := sanity.NewTestConfig()
	cfg.Address = "unix://" + cl.nodeSock
	cfg.ControllerAddress = "unix://" + cl.controllerSock
	cfg.TargetPath = filepath.Join(cl.dir, accessType, "target")
	cfg.StagingPath = filepath.Join(cl.dir, accessType, "staging")
	if err := os.MkdirAll(filepath.Join(cl.dir, accessType), 0o755); err != nil {
		panic(err)
	}
	cfg.TestVolumeSize = 64 << 20
	cfg.TestVolumeExpandSize = 128 << 20
	cfg.TestVolumeParameters = map[string]string{"transport": "fuse"}
	cfg.TestVolumeAccessType = accessType
	cfg.TestNodeVolumeAttachLimit = true
	cfg.IdempotentCount = 2
	return cfg
}

// TestSanity runs every csi-sanity spec for Filesystem volumes, then, in
// a child process, for Block volumes.
func TestSanity(t *testing.T) {
	at := os.Getenv(accessEnv)
	if at == "" {
		at = "mount"
		defer runChild(t, "block")
	}
	cl := startCluster(t)
	t.Logf("csi-sanity with %s volumes", at)
	sanity.Test(t, cl.config(at))
	cl.checkClean(t)
}

// runChild runs TestSanity again in a new process of this test binary for
// access type at.
func runChild(t *testing.T, at string) {
	if t.Failed() {
		return
	}
	cmd := exec.Command(os.Args[0], "-test.run", "^TestSanity$", "-test.v", "-test.count", "1")
	cmd.Env = append(os.Environ(), accessEnv+"="+at)
	out, err := cmd.CombinedOutput()
	summary := ""
	for _, l := range strings.Split(string(out), "\n") {
		if strings.Contains(l, "Passed") || strings.HasPrefix(l, "Ran ") {
			summary += l + "\n"
		}
	}
	if err != nil {
		t.Errorf("csi-sanity with %s volumes: %v\n%s", at, err, tail(string(out), 400))
		return
	}
	t.Logf("csi-sanity with %s volumes:\n%s", at, summary)
}

// checkClean verifies that nothing csi-sanity created is left: volumes
// and snapshots (and so their files), publication Secrets, mounts.
func (cl *cluster) checkClean(t *testing.T) {
	t.Helper()
	ctx := context.Background()
	waitFor(t, "every volume to be gone", time.Minute, func() error {
		vols := &v1alpha1.NBDVolumeList{}
		if err := cl.client.List(ctx, vols); err != nil {
			return err
		}
		if n := len(vols.Items); n > 0 {
			return fmt.Errorf("%d volumes left, e.g. %s", n, vols.Items[0].Name)
		}
		files, _ := filepath.Glob(filepath.Join(cl.dir, "volumes", "*.img"))
		if len(files) > 0 {
			return fmt.Errorf("backing files left: %v", files)
		}
		snaps := &v1alpha1.NBDSnapshotList{}
		if err := cl.client.List(ctx, snaps); err != nil {
			return err
		}
		if n := len(snaps.Items); n > 0 {
			return fmt.Errorf("%d snapshots left, e.g. %s", n, snaps.Items[0].Name)
		}
		if files, _ := filepath.Glob(filepath.Join(cl.dir, "volumes", "*.snap")); len(files) > 0 {
			return fmt.Errorf("snapshot files left: %v", files)
		}
		return nil
	})
	secrets := &corev1.SecretList{}
	// Publication Secrets carry the volume label; the controller's CA
	// (Secret mpnbd-ca) is meant to stay.
	if err := cl.client.List(ctx, secrets, client.InNamespace(namespace), client.HasLabels{access.LabelVolume}); err != nil {
		t.Fatal(err)
	}
	if len(secrets.Items) > 0 {
		t.Errorf("%d publication secrets left, e.g. %s", len(secrets.Items), secrets.Items[0].Name)
	}
	mounts, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(string(mounts), cl.dir) {
		t.Errorf("mounts left under %s:\n%s", cl.dir, mounts)
	}
}
