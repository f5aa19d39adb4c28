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

package driver

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"

	"github.com/mpnbd/mpnbd/pkg/access"
	"github.com/mpnbd/mpnbd/pkg/attach"
	"github.com/mpnbd/mpnbd/pkg/attach/fuse"
	"github.com/mpnbd/mpnbd/pkg/blockdev"
	"github.com/mpnbd/mpnbd/pkg/mountinfo"
	"github.com/mpnbd/mpnbd/pkg/mptcp"
	"github.com/mpnbd/mpnbd/pkg/nbd"
)

// fuseNode is a Node over a real NBD server on the loopback address, the
// fuse transport (its server processes are this test binary, see
// TestMain) and the real mounter.
type fuseNode struct {
	node     *Node
	mgr      *attach.Manager
	root     string
	stateDir string
	addr     string
}

const fuseExportSize = 64 << 20

func newFuseNode(t *testing.T, exports ...string) *fuseNode {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("skipping: mounting needs root")
	}
	if err := fuse.Available(); err != nil {
		t.Skipf("skipping: %v", err)
	}
	for _, tool := range []string{"mkfs.ext4", "blkid", "mount", "umount"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("skipping: %s not found: %v", tool, err)
		}
	}
	ctx := context.Background()
	l, err := mptcp.Listen(ctx, "tcp", "127.0.0.1:0", mptcp.Available() == nil)
	if err != nil {
		t.Fatal(err)
	}
	srv := &nbd.Server{Logger: slog.New(slog.DiscardHandler)}
	for _, e := range exports {
		if err := srv.AddExport(&nbd.Export{Name: access.NodeExport(e, testNodeToken), Backend: nbd.NewMemBackend(fuseExportSize)}); err != nil {
			t.Fatal(err)
		}
	}
	go srv.Serve(l)
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		srv.Shutdown(ctx)
	})

	root := t.TempDir()
	f := &fuseNode{root: root, stateDir: filepath.Join(root, "fuse"), addr: l.Addr().String()}
	log := slog.New(slog.DiscardHandler)
	f.mgr = attach.NewManager(map[attach.Transport]attach.Attacher{
		attach.FUSE: fuse.New(fuse.Config{StateDir: f.stateDir, Logger: log}),
	}, log)
	f.node, err = NewNode(NodeConfig{NodeID: "node-1", Attacher: f.mgr, Mounter: NewMounter(), Logger: log, Token: testNodeToken})
	if err != nil {
		t.Fatal(err)
	}
	// After a failure, leave nothing mounted or attached.
	t.Cleanup(func() {
		for _, mp := range mountsUnder(t, root) {
			if !strings.HasPrefix(mp, f.stateDir) {
				if err := unix.Unmount(mp, unix.MNT_DETACH); err != nil {
					t.Logf("cleanup: unmount %s: %v", mp, err)
				}
			}
		}
		for _, e := range exports {
			if err := f.mgr.Detach(context.Background(), volumeOf(e)); err != nil {
				t.Logf("cleanup: detach %s: %v", volumeOf(e), err)
			}
		}
	})
	return f
}

// volumeOf is the volume ID of an export name "<volume>.<token>".
func volumeOf(export string) string {
	id, _, _ := strings.Cut(export, ".")
	return id
}

func (f *fuseNode) stageReq(export string, c *csi.VolumeCapability) *csi.NodeStageVolumeRequest {
	id := volumeOf(export)
	return &csi.NodeStageVolumeRequest{
		VolumeId:          id,
		StagingTargetPath: filepath.Join(f.root, "staging", id),
		VolumeCapability:  c,
		PublishContext:    map[string]string{PublishContextExport: export, PublishContextAddresses: f.addr},
		VolumeContext:     map[string]string{ParamTransport: "fuse"},
	}
}

func (f *fuseNode) publishReq(stage *csi.NodeStageVolumeRequest, target string) *csi.NodePublishVolumeRequest {
	return &csi.NodePublishVolumeRequest{
		VolumeId:          stage.VolumeId,
		StagingTargetPath: stage.StagingTargetPath,
		TargetPath:        filepath.Join(f.root, "pods", target),
		VolumeCapability:  stage.VolumeCapability,
		PublishContext:    stage.PublishContext,
		VolumeContext:     stage.VolumeContext,
	}
}

func (f *fuseNode) stageAndPublish(t *testing.T, stage *csi.NodeStageVolumeRequest, pub *csi.NodePublishVolumeRequest) {
	t.Helper()
	ctx := context.Background()
	if _, err := f.node.NodeStageVolume(ctx, stage); err != nil {
		t.Fatalf("stage: %v", err)
	}
	if _, err := f.node.NodePublishVolume(ctx, pub); err != nil {
		t.Fatalf("publish: %v", err)
	}
}

func (f *fuseNode) unpublishAndUnstage(t *testing.T, stage *csi.NodeStageVolumeRequest, pub *csi.NodePublishVolumeRequest) {
	t.Helper()
	ctx := context.Background()
	if _, err := f.node.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: pub.VolumeId, TargetPath: pub.TargetPath}); err != nil {
		t.Fatalf("unpublish: %v", err)
	}
	if _, err := f.node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: stage.VolumeId, StagingTargetPath: stage.StagingTargetPath}); err != nil {
		t.Fatalf("unstage: %v", err)
	}
}

// assertNothingLeft checks that no mount under the test's directory, no
// loop device on the volume's FUSE file and no attachment remain.
func (f *fuseNode) assertNothingLeft(t *testing.T, id string) {
	t.Helper()
	if m := mountsUnder(t, f.root); len(m) != 0 {
		t.Errorf("mounts left: %v", m)
	}
	devs, err := blockdev.FindLoopByBackingFile(filepath.Join(f.stateDir, id, id))
	if err != nil {
		t.Fatal(err)
	}
	if len(devs) != 0 {
		t.Errorf("loop devices left on the FUSE file of %s: %v", id, devs)
	}
	if _, ok := f.mgr.Chosen(id); ok {
		t.Errorf("volume %s still attached", id)
	}
}

func TestNodeFUSEFilesystem(t *testing.T) {
	f := newFuseNode(t, "pv-fs.tok1")
	ctx := context.Background()
	stage := f.stageReq("pv-fs.tok1", mountCap(rwo, "ext4"))
	pub := f.publishReq(stage, "pod-a/mount")

	f.stageAndPublish(t, stage, pub)
	// A second stage and publish change nothing.
	f.stageAndPublish(t, stage, pub)
	data := make([]byte, 4<<20)
	rand.Read(data)
	sum := sha256.Sum256(data)
	if err := writeFileSync(filepath.Join(pub.TargetPath, "data"), data); err != nil {
		t.Fatal(err)
	}
	stats, err := f.node.NodeGetVolumeStats(ctx, &csi.NodeGetVolumeStatsRequest{VolumeId: stage.VolumeId, VolumePath: pub.TargetPath})
	if err != nil {
		t.Fatal(err)
	}
	u := stats.GetUsage()
	if len(u) != 2 || u[0].Used < int64(len(data)) || u[0].Total < fuseExportSize/2 || u[1].Used == 0 {
		t.Errorf("usage %v", u)
	}
	h, err := f.node.NodeGetVolumeHealth(ctx, &csi.NodeGetVolumeHealthRequest{VolumeId: stage.VolumeId, VolumePublishPath: pub.TargetPath})
	if err != nil || len(h.GetVolumeHealth().GetHealthStatuses()) != 0 {
		t.Errorf("health %v, %v; want healthy", h, err)
	}
	exp, err := f.node.NodeExpandVolume(ctx, &csi.NodeExpandVolumeRequest{VolumeId: stage.VolumeId, VolumePath: pub.TargetPath, StagingTargetPath: stage.StagingTargetPath})
	if err != nil {
		t.Fatal(err)
	}
	if exp.CapacityBytes != fuseExportSize {
		t.Errorf("expanded capacity %d, want %d", exp.CapacityBytes, fuseExportSize)
	}
	f.unpublishAndUnstage(t, stage, pub)
	f.assertNothingLeft(t, stage.VolumeId)
	if _, err := f.node.NodeGetVolumeStats(ctx, &csi.NodeGetVolumeStatsRequest{VolumeId: stage.VolumeId, VolumePath: pub.TargetPath}); err == nil {
		t.Errorf("stats of an unpublished volume succeed")
	}

	// The data survives a detach: stage (no format this time) and
	// publish read-only to another target.
	pub = f.publishReq(stage, "pod-b/mount")
	pub.Readonly = true
	f.stageAndPublish(t, stage, pub)
	got, err := os.ReadFile(filepath.Join(pub.TargetPath, "data"))
	if err != nil {
		t.Fatal(err)
	}
	if sha256.Sum256(got) != sum {
		t.Errorf("file changed across unstage and stage")
	}
	if err := os.WriteFile(filepath.Join(pub.TargetPath, "other"), nil, 0o600); err == nil {
		t.Errorf("write to a read-only publish succeeded")
	}
	f.unpublishAndUnstage(t, stage, pub)
	f.unpublishAndUnstage(t, stage, pub)
	f.assertNothingLeft(t, stage.VolumeId)
}

func TestNodeFUSEBlock(t *testing.T) {
	f := newFuseNode(t, "pv-blk.tok2")
	ctx := context.Background()
	stage := f.stageReq("pv-blk.tok2", blockCap(rwo))
	pub := f.publishReq(stage, "pod-a/dev")
	f.stageAndPublish(t, stage, pub)
	f.stageAndPublish(t, stage, pub)

	data := make([]byte, 64<<10)
	rand.Read(data)
	dev, err := os.OpenFile(pub.TargetPath, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := dev.WriteAt(data, 1<<20); err != nil {
		t.Fatal(err)
	}
	if err := dev.Sync(); err != nil {
		t.Fatal(err)
	}
	dev.Close()
	stats, err := f.node.NodeGetVolumeStats(ctx, &csi.NodeGetVolumeStatsRequest{VolumeId: stage.VolumeId, VolumePath: pub.TargetPath})
	if err != nil {
		t.Fatal(err)
	}
	if u := stats.GetUsage(); len(u) != 1 || u[0].Total != fuseExportSize {
		t.Errorf("usage %v", u)
	}
	f.unpublishAndUnstage(t, stage, pub)
	f.assertNothingLeft(t, stage.VolumeId)

	// Read it back through a new attach.
	f.stageAndPublish(t, stage, pub)
	dev, err = os.Open(pub.TargetPath)
	if err != nil {
		t.Fatal(err)
	}
	got := make([]byte, len(data))
	_, err = dev.ReadAt(got, 1<<20)
	dev.Close()
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, data) {
		t.Errorf("block data changed across unstage and stage")
	}
	f.unpublishAndUnstage(t, stage, pub)
	f.assertNothingLeft(t, stage.VolumeId)
}

func writeFileSync(path string, data []byte) error {
	fl, err := os.Create(path)
	if err != nil {
		return err
	}
	if _, err := fl.Write(data); err != nil {
		fl.Close()
		return err
	}
	if err := fl.Sync(); err != nil {
		fl.Close()
		return err
	}
	return fl.Close()
}

// mountsUnder lists the mount points at or below dir, deepest first.
func mountsUnder(t *testing.T, dir string) []string {
	t.Helper()
	mps, err := mountinfo.Under(dir)
	if err != nil {
		t.Fatal(err)
	}
	return mps
}
