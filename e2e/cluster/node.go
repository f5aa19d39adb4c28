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
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/mpnbd/mpnbd/internal/testenv/repo"
)

// runtime starts containerd with its own root, state, socket and CNI
// configuration, and imports the pause image.
func (c *Cluster) runtime(ctx context.Context) error {
	c.Containerd = c.path("containerd", "containerd.sock")
	cniConf := c.path("cni", "net.d")
	for _, d := range []string{cniConf, c.path("containerd")} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return err
		}
	}
	conflist := fmt.Sprintf(`{
  "cniVersion": "0.4.0",
  "name": "mpnbd-e2e",
  "plugins": [
    {"type": "bridge", "bridge": "mpnbd-e2e0", "isGateway": true, "ipMasq": false,
     "ipam": {"type": "host-local", "ranges": [[{"subnet": %q}]], "routes": [{"dst": "0.0.0.0/0"}]}},
    {"type": "portmap", "capabilities": {"portMappings": true}}
  ]
}
`, podCIDR)
	if err := os.WriteFile(filepath.Join(cniConf, "10-mpnbd-e2e.conflist"), []byte(conflist), 0o644); err != nil {
		return err
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
`, c.path("containerd", "root"), c.path("containerd", "state"), c.Containerd, PauseImage, cniConf)
	cfgPath := c.path("containerd", "config.toml")
	if err := os.WriteFile(cfgPath, []byte(config), 0o644); err != nil {
		return err
	}
	// The pod bridge exists before any pod, with the gateway address, so
	// that host-network pods reach the API server at PodGateway too.
	for _, args := range [][]string{
		{"link", "add", "mpnbd-e2e0", "type", "bridge"},
		{"addr", "add", PodGateway + "/24", "dev", "mpnbd-e2e0"},
		{"link", "set", "mpnbd-e2e0", "up"},
	} {
		if out, err := exec.Command("ip", args...).CombinedOutput(); err != nil {
			return fmt.Errorf("ip %s: %w: %s", strings.Join(args, " "), err, out)
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
	return c.importPause(ctx)
}

// ctr runs ctr against our containerd in the CRI namespace.
func (c *Cluster) ctr(ctx context.Context, args ...string) (string, error) {
	out, err := exec.CommandContext(ctx, "ctr", append([]string{"-a", c.Containerd, "-n", "k8s.io"}, args...)...).CombinedOutput()
	if err != nil {
		return string(out), fmt.Errorf("ctr %s: %w: %s", strings.Join(args, " "), err, out)
	}
	return string(out), nil
}

// ImportImage imports an image tarball (Image.Build) into the node.
func (c *Cluster) ImportImage(ctx context.Context, tarPath string) error {
	_, err := c.ctr(ctx, "images", "import", "--no-unpack=false", tarPath)
	return err
}

// TagImage gives the image src the reference dst too.
func (c *Cluster) TagImage(ctx context.Context, src, dst string) error {
	_, err := c.ctr(ctx, "images", "tag", "--force", src, dst)
	return err
}

func (c *Cluster) importPause(ctx context.Context) error {
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
	tarPath := c.path("images", "pause.tar")
	im := Image{Ref: PauseImage, Files: map[string]string{"/pause": bin}, Entrypoint: []string{"/pause"}}
	if err := im.Build(tarPath); err != nil {
		return err
	}
	return c.ImportImage(ctx, tarPath)
}

// kubelet starts the kubelet and waits for the node to be Ready.
func (c *Cluster) kubelet(ctx context.Context) error {
	root := c.path("kubelet")
	if err := os.MkdirAll(root, 0o755); err != nil {
		return err
	}
	config := fmt.Sprintf(`apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
cgroupDriver: cgroupfs
failSwapOn: false
containerRuntimeEndpoint: unix://%s
address: 127.0.0.1
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
`, c.Containerd)
	cfgPath := c.path("kubelet-config.yaml")
	if err := os.WriteFile(cfgPath, []byte(config), 0o644); err != nil {
		return err
	}
	if err := c.start("kubelet", filepath.Join(c.cfg.KubeBin, "kubelet"),
		"--config", cfgPath, "--kubeconfig", c.path("kubelet.kubeconfig"),
		"--root-dir", root, "--hostname-override", c.NodeName, "--v", "2"); err != nil {
		return err
	}
	return c.waitFor("node "+c.NodeName+" Ready", 3*time.Minute, func() error {
		out, err := c.Kubectl(ctx, "get", "node", c.NodeName, "-o",
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

// KubeletRoot is the kubelet's root directory.
func (c *Cluster) KubeletRoot() string { return c.path("kubelet") }
