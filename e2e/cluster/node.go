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
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/mpnbd/mpnbd/internal/testenv/repo"
)

// runtime starts containerd with its own root, state, socket and CNI
// configuration, and imports the pause image.
func (c *Cluster) runtime(ctx context.Context) error {
	c.Containerd = c.path("containerd", "containerd.sock")
	cfgPath, err := writeRuntimeConfig(c.cfg.Dir, c.Containerd, podCIDR, "")
	if err != nil {
		return err
	}
	// The pod bridge exists before any pod, with the gateway address, so
	// that host-network pods reach the API server at PodGateway too.
	for _, args := range [][]string{
		{"link", "add", "mpnbd-e2e0", "type", "bridge"},
		{"addr", "add", PodGateway + "/24", "dev", "mpnbd-e2e0"},
		{"link", "set", "mpnbd-e2e0", "up"},
	} {
		if err := ipCmd(args...); err != nil {
			return err
		}
	}
	if err := c.start("containerd", "containerd", "--config", cfgPath); err != nil {
		return err
	}
	if err := c.waitFor("containerd", time.Minute, func() error {
		_, err := c.ctr(ctx, "version")
		return err
	}); err != nil {
		return err
	}
	if err := c.buildPause(ctx); err != nil {
		return err
	}
	return importInto(ctx, c.Containerd, c.pauseTar)
}

// writeRuntimeConfig writes containerd's configuration (its root, state
// and socket under base/containerd) and the CNI network (a bridge with
// podCIDR; host-local keeps its leases in ipamDir, or its default when
// empty), returning containerd's configuration file.
func writeRuntimeConfig(base, socket, podCIDR, ipamDir string) (string, error) {
	cniConf := filepath.Join(base, "cni", "net.d")
	for _, d := range []string{cniConf, filepath.Join(base, "containerd")} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return "", err
		}
	}
	dataDir := ""
	if ipamDir != "" {
		dataDir = fmt.Sprintf(`, "dataDir": %q`, ipamDir)
	}
	conflist := fmt.Sprintf(`{
  "cniVersion": "0.4.0",
  "name": "mpnbd-e2e",
  "plugins": [
    {"type": "bridge", "bridge": "mpnbd-e2e0", "isGateway": true, "ipMasq": false,
     "ipam": {"type": "host-local", "ranges": [[{"subnet": %q}]], "routes": [{"dst": "0.0.0.0/0"}]%s}},
    {"type": "portmap", "capabilities": {"portMappings": true}}
  ]
}
`, podCIDR, dataDir)
	if err := os.WriteFile(filepath.Join(cniConf, "10-mpnbd-e2e.conflist"), []byte(conflist), 0o644); err != nil {
		return "", err
	}
	config := fmt.Sprintf(`version = 2
root = %q
state = %q
[grpc]
  address = %q
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = %q
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = %q
`, filepath.Join(base, "containerd", "root"), filepath.Join(base, "containerd", "state"), socket, PauseImage, cniConf)
	cfgPath := filepath.Join(base, "containerd", "config.toml")
	return cfgPath, os.WriteFile(cfgPath, []byte(config), 0o644)
}

// ctr runs ctr against the host's containerd in the CRI namespace.
func (c *Cluster) ctr(ctx context.Context, args ...string) (string, error) {
	return ctr(ctx, c.Containerd, args...)
}

// ctr runs ctr against the containerd at socket in the CRI namespace.
func ctr(ctx context.Context, socket string, args ...string) (string, error) {
	out, err := exec.CommandContext(ctx, "ctr", append([]string{"-a", socket, "-n", "k8s.io"}, args...)...).CombinedOutput()
	if err != nil {
		return string(out), fmt.Errorf("ctr %s: %w: %s", strings.Join(args, " "), err, out)
	}
	return string(out), nil
}

func importInto(ctx context.Context, socket, tarPath string) error {
	_, err := ctr(ctx, socket, "images", "import", "--no-unpack=false", tarPath)
	return err
}

// runtimes are the containerd sockets of the running nodes, of those
// named in only if it names any.
func (c *Cluster) runtimes(only ...string) []string {
	if len(c.Nodes) == 0 {
		return []string{c.Containerd}
	}
	var s []string
	for _, n := range c.Nodes {
		if n.Up() && (len(only) == 0 || slices.Contains(only, n.Name)) {
			s = append(s, n.Containerd)
		}
	}
	return s
}

// ImportImage imports an image tarball (Image.Build) into every running
// node, or only into the nodes named in only when it names any (a node
// killed later keeps it: its containerd's root is its disk). A cluster
// of one node (no Config.Nodes) imports into its node whatever only says.
func (c *Cluster) ImportImage(ctx context.Context, tarPath string, only ...string) error {
	socks := c.runtimes(only...)
	errs := make([]error, len(socks))
	var wg sync.WaitGroup
	for i, sock := range socks {
		wg.Go(func() { errs[i] = importInto(ctx, sock, tarPath) })
	}
	wg.Wait()
	return errors.Join(errs...)
}

// TagImage gives the image src the reference dst too, on every running
// node.
func (c *Cluster) TagImage(ctx context.Context, src, dst string) error {
	for _, sock := range c.runtimes() {
		if _, err := ctr(ctx, sock, "images", "tag", "--force", src, dst); err != nil {
			return err
		}
	}
	return nil
}

// buildPause builds the pause image's tarball.
func (c *Cluster) buildPause(ctx context.Context) error {
	bin := c.path("images", "pause")
	if err := os.MkdirAll(filepath.Dir(bin), 0o755); err != nil {
		return err
	}
	root, err := repo.Root()
	if err != nil {
		return err
	}
	// The pause command is in the e2e module (e2e/go.mod).
	build := exec.CommandContext(ctx, "go", "build", "-trimpath", "-o", bin, "./cluster/pause")
	build.Dir = filepath.Join(root, "e2e")
	build.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := build.CombinedOutput(); err != nil {
		return fmt.Errorf("build the pause image: %w: %s", err, out)
	}
	c.pauseTar = c.path("images", "pause.tar")
	im := Image{Ref: PauseImage, Files: map[string]string{"/pause": bin}, Entrypoint: []string{"/pause"}}
	return im.Build(c.pauseTar)
}

// kubelet starts the host's kubelet and waits for the node to be Ready.
func (c *Cluster) kubelet(ctx context.Context) error {
	root := c.path("kubelet")
	if err := os.MkdirAll(root, 0o755); err != nil {
		return err
	}
	cfgPath, err := writeKubeletConfig(c.cfg.Dir, c.Containerd, "127.0.0.1", "")
	if err != nil {
		return err
	}
	if err := c.start("kubelet", filepath.Join(c.cfg.KubeBin, "kubelet"),
		"--config", cfgPath, "--kubeconfig", c.path("kubelet.kubeconfig"),
		"--root-dir", root, "--hostname-override", c.NodeName, "--v", "2"); err != nil {
		return err
	}
	return c.waitNodeReady(ctx, c.NodeName)
}

// writeKubeletConfig writes base/kubelet-config.yaml: the kubelet listens
// on address, uses the containerd at socket and puts its pods under
// cgroupRoot (empty: the root).
func writeKubeletConfig(base, socket, address, cgroupRoot string) (string, error) {
	config := fmt.Sprintf(`apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
cgroupDriver: cgroupfs
failSwapOn: false
containerRuntimeEndpoint: unix://%s
address: %s
readOnlyPort: 0
evictionHard: {}
imageGCHighThresholdPercent: 100
enforceNodeAllocatable: []
authentication:
  anonymous: {enabled: true}
  webhook: {enabled: false}
authorization: {mode: AlwaysAllow}
clusterDomain: cluster.local
staticPodPath: ""
`, socket, address)
	if cgroupRoot != "" {
		config += "cgroupRoot: " + cgroupRoot + "\n"
	}
	cfgPath := filepath.Join(base, "kubelet-config.yaml")
	return cfgPath, os.WriteFile(cfgPath, []byte(config), 0o644)
}

// waitNodeReady waits for the Node's Ready condition.
func (c *Cluster) waitNodeReady(ctx context.Context, name string) error {
	return c.waitFor("node "+name+" Ready", 3*time.Minute, func() error {
		out, err := c.Kubectl(ctx, "get", "node", name, "-o",
			`jsonpath={.status.conditions[?(@.type=="Ready")].status}`)
		if err != nil {
			return err
		}
		if strings.TrimSpace(out) != "True" {
			return fmt.Errorf("Ready=%q", out)
		}
		return nil
	})
}

// KubeletRoot is the kubelet's root directory (a node's: the usual path,
// in its mount namespace).
func (c *Cluster) KubeletRoot() string {
	if len(c.Nodes) > 0 {
		return "/var/lib/kubelet"
	}
	return c.path("kubelet")
}
