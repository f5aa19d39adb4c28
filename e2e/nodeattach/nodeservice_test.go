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

package nodeattach

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"

	"github.com/mpnbd/mpnbd/pkg/access"
	"github.com/mpnbd/mpnbd/pkg/attach"
	"github.com/mpnbd/mpnbd/pkg/driver"
	"github.com/mpnbd/mpnbd/pkg/ublk"
)

// TestNodeServiceKernelTransports drives the real CSI Node service
// (driver.Node with the real mounter and an attach.Manager over the nbd
// transports) against the kernel's nbd driver: stage (format and mount
// through mount-utils), publish, write, stats, health, online expansion
// (the export grows, RECONFIGURE resizes /dev/nbdX, resize2fs grows the
// mounted file system), unpublish, unstage; then the same for a Block
// volume. Nothing is left connected afterwards.
func TestNodeServiceKernelTransports(t *testing.T) {
	requireGuest(t)
	for _, mode := range []attach.Transport{attach.Relay, attach.MultiConn} {
		t.Run(string(mode), func(t *testing.T) {
			tp := guestTopology(t)
			st := newStorage(t, tp, volSize/2, mode == attach.Relay)
			a, nl := newAttacher(t, tp, mode)
			nodeServiceFlow(t, st, mode, a, func() { waitGone(t, nl, st) })
		})
	}
}

// TestNodeServiceUblk is the same through the ublk transport, whose online
// expansion needs a driver that can resize a device (6.14 and later:
// TestNodeAttachUblkNewestInVM boots one).
func TestNodeServiceUblk(t *testing.T) {
	requireUblkGuest(t)
	ctrl, err := ublk.OpenControl()
	if err != nil {
		t.Fatal(err)
	}
	f, err := ctrl.Features()
	ctrl.Close()
	if err != nil || f&ublk.FlagUpdateSize == 0 {
		t.Skipf("this kernel's ublk driver cannot resize a device (features %#x, %v): TestNodeAttachUblkNewestInVM boots one that can", f, err)
	}
	tp := guestTopology(t)
	st := newStorage(t, tp, volSize/2, true)
	a := newUblkAttacher(t, tp, t.TempDir())
	nodeServiceFlow(t, st, attach.Ublk, a, func() { waitUblkGone(t, st) })
}

// waitUblkGone waits until no ublk block device is left and the server
// has no connection.
func waitUblkGone(t *testing.T, st *storage) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		devs, _ := filepath.Glob("/dev/ublkb*")
		n := st.conns()
		if len(devs) == 0 && n == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("left behind: ublk devices %v, server connections %d", devs, n)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// nodeServiceFlow stages, publishes, writes, expands, unpublishes and
// unstages a Mount and then a Block volume through the Node service over
// attacher a of transport mode; gone checks that nothing is left after
// each unstage.
func nodeServiceFlow(t *testing.T, st *storage, mode attach.Transport, a attach.Attacher, gone func()) {
	t.Helper()
	mgr := attach.NewManager(map[attach.Transport]attach.Attacher{mode: a}, testLogger(t))
	token, err := access.NewToken()
	if err != nil {
		t.Fatal(err)
	}
	node, err := driver.NewNode(driver.NodeConfig{
		NodeID: "vm-node", Attacher: mgr, Mounter: driver.NewMounter(), Logger: testLogger(t), Token: token,
	})
	if err != nil {
		t.Fatal(err)
	}
	tg := st.target(volID(t))
	ctx := context.Background()
	dir := t.TempDir()
	mountCap := &csi.VolumeCapability{
		AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{FsType: "ext4"}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER},
	}
	stage := &csi.NodeStageVolumeRequest{
		VolumeId:          tg.VolumeID,
		StagingTargetPath: filepath.Join(dir, "staging"),
		VolumeCapability:  mountCap,
		PublishContext: map[string]string{
			driver.PublishContextExport:    tg.Export,
			driver.PublishContextAddresses: strings.Join(tg.Addrs, ","),
		},
		VolumeContext: map[string]string{driver.ParamTransport: string(mode)},
	}
	if err := os.MkdirAll(stage.StagingTargetPath, 0o750); err != nil {
		t.Fatal(err)
	}
	for range 2 { // idempotent
		if _, err := node.NodeStageVolume(ctx, stage); err != nil {
			t.Fatalf("stage: %v", err)
		}
	}
	pub := &csi.NodePublishVolumeRequest{
		VolumeId: tg.VolumeID, StagingTargetPath: stage.StagingTargetPath,
		TargetPath: filepath.Join(dir, "target"), VolumeCapability: mountCap,
		PublishContext: stage.PublishContext, VolumeContext: stage.VolumeContext,
	}
	if _, err := node.NodePublishVolume(ctx, pub); err != nil {
		t.Fatalf("publish: %v", err)
	}
	sum := writeRandomFile(t, filepath.Join(pub.TargetPath, "data"), dataSize)
	stats, err := node.NodeGetVolumeStats(ctx, &csi.NodeGetVolumeStatsRequest{VolumeId: tg.VolumeID, VolumePath: pub.TargetPath})
	if err != nil || len(stats.GetUsage()) != 2 || stats.Usage[0].Used < dataSize {
		t.Fatalf("stats %v, %v", stats, err)
	}
	before := stats.Usage[0].Total
	h, err := node.NodeGetVolumeHealth(ctx, &csi.NodeGetVolumeHealthRequest{VolumeId: tg.VolumeID, VolumePublishPath: pub.TargetPath})
	if err != nil || len(h.GetVolumeHealth().GetHealthStatuses()) != 0 {
		t.Fatalf("health %v, %v; want healthy (relay: one subflow per path)", h, err)
	}

	// Online expansion: the storage side grows, then the node.
	if err := st.backend.Resize(2 * st.size); err != nil {
		t.Fatal(err)
	}
	exp, err := node.NodeExpandVolume(ctx, &csi.NodeExpandVolumeRequest{
		VolumeId: tg.VolumeID, VolumePath: pub.TargetPath, StagingTargetPath: stage.StagingTargetPath,
		CapacityRange: &csi.CapacityRange{RequiredBytes: 2 * st.size}, VolumeCapability: mountCap,
	})
	if err != nil || exp.GetCapacityBytes() != 2*st.size {
		t.Fatalf("expand: %v, %v", exp, err)
	}
	stats, err = node.NodeGetVolumeStats(ctx, &csi.NodeGetVolumeStatsRequest{VolumeId: tg.VolumeID, VolumePath: pub.TargetPath})
	if err != nil || stats.Usage[0].Total < before*3/2 {
		t.Fatalf("file system after expansion: %v, %v (was %d bytes)", stats, err, before)
	}
	if got := fileSum(t, filepath.Join(pub.TargetPath, "data")); got != sum {
		t.Fatalf("data after expansion: sha256 %s, want %s", got, sum)
	}

	if _, err := node.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: tg.VolumeID, TargetPath: pub.TargetPath}); err != nil {
		t.Fatal(err)
	}
	for range 2 {
		if _, err := node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: tg.VolumeID, StagingTargetPath: stage.StagingTargetPath}); err != nil {
			t.Fatalf("unstage: %v", err)
		}
	}
	gone()

	// Block: the device node is published as is.
	blockCap := &csi.VolumeCapability{
		AccessType: &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}},
		AccessMode: mountCap.AccessMode,
	}
	stage.VolumeCapability, pub.VolumeCapability = blockCap, blockCap
	pub.TargetPath = filepath.Join(dir, "block-target")
	if _, err := node.NodeStageVolume(ctx, stage); err != nil {
		t.Fatalf("stage block: %v", err)
	}
	if _, err := node.NodePublishVolume(ctx, pub); err != nil {
		t.Fatalf("publish block: %v", err)
	}
	size, err := driver.NewMounter().GetDeviceSize(pub.TargetPath)
	if err != nil || int64(size) != 2*st.size {
		t.Fatalf("published block device: %d bytes, %v; want %d", size, err, 2*st.size)
	}
	// The file system written above is on it.
	if got := mountAndSum(t, pub.TargetPath); got != sum {
		t.Fatalf("block device content: sha256 %s, want %s", got, sum)
	}
	if _, err := node.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: tg.VolumeID, TargetPath: pub.TargetPath}); err != nil {
		t.Fatal(err)
	}
	if _, err := node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: tg.VolumeID, StagingTargetPath: stage.StagingTargetPath}); err != nil {
		t.Fatal(err)
	}
	gone()
}
