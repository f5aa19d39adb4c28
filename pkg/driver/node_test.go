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
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/mpnbd/mpnbd/pkg/access"
	"github.com/mpnbd/mpnbd/pkg/attach"
)

type nodeFixture struct {
	node *Node
	att  *fakeAttacher
	mnt  *fakeMounter
	dir  string
}

func newNodeFixture(t *testing.T) *nodeFixture {
	t.Helper()
	f := &nodeFixture{att: newFakeAttacher(), mnt: newFakeMounter(), dir: t.TempDir()}
	n, err := NewNode(NodeConfig{NodeID: "node-1", Topology: map[string]string{"topology.mpnbd.io/zone": "a"}, MaxVolumes: 16, Attacher: f.att, Mounter: f.mnt, Logger: slog.New(slog.DiscardHandler), Token: testNodeToken})
	if err != nil {
		t.Fatal(err)
	}
	f.node = n
	return f
}

func mountCap(mode csi.VolumeCapability_AccessMode_Mode, fsType string, flags ...string) *csi.VolumeCapability {
	return &csi.VolumeCapability{
		AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{FsType: fsType, MountFlags: flags}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: mode},
	}
}

func blockCap(mode csi.VolumeCapability_AccessMode_Mode) *csi.VolumeCapability {
	return &csi.VolumeCapability{
		AccessType: &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: mode},
	}
}

const rwo = csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER

func (f *nodeFixture) stageReq(id string, c *csi.VolumeCapability) *csi.NodeStageVolumeRequest {
	return &csi.NodeStageVolumeRequest{
		VolumeId:          id,
		StagingTargetPath: filepath.Join(f.dir, "staging", id),
		VolumeCapability:  c,
		PublishContext:    map[string]string{PublishContextExport: id, PublishContextAddresses: "10.0.0.1:10809,10.0.1.1:10809"},
		VolumeContext:     map[string]string{ParamFSType: "ext4", "storage.kubernetes.io/csiProvisionerIdentity": "x"},
	}
}

func wantCode(t *testing.T, err error, want codes.Code) {
	t.Helper()
	if want == codes.OK {
		if err != nil {
			t.Fatalf("unexpected error: %v", err)
		}
		return
	}
	st, ok := status.FromError(err)
	if err == nil || !ok || st.Code() != want {
		t.Fatalf("error %v, want code %s", err, want)
	}
}

func TestNodeStageVolumeErrors(t *testing.T) {
	tests := []struct {
		name   string
		mutate func(*csi.NodeStageVolumeRequest)
		want   codes.Code
		msg    string
	}{
		{"no volume id", func(r *csi.NodeStageVolumeRequest) { r.VolumeId = "" }, codes.InvalidArgument, "volume_id"},
		{"no staging path", func(r *csi.NodeStageVolumeRequest) { r.StagingTargetPath = "" }, codes.InvalidArgument, "staging_target_path"},
		{"no capability", func(r *csi.NodeStageVolumeRequest) { r.VolumeCapability = nil }, codes.InvalidArgument, "volume_capability"},
		{"no access type", func(r *csi.NodeStageVolumeRequest) {
			r.VolumeCapability = &csi.VolumeCapability{AccessMode: &csi.VolumeCapability_AccessMode{Mode: rwo}}
		}, codes.InvalidArgument, "access type"},
		{"no access mode", func(r *csi.NodeStageVolumeRequest) { r.VolumeCapability.AccessMode = nil }, codes.InvalidArgument, "access mode"},
		{"multi-node single writer", func(r *csi.NodeStageVolumeRequest) {
			r.VolumeCapability = mountCap(csi.VolumeCapability_AccessMode_MULTI_NODE_SINGLE_WRITER, "")
		}, codes.InvalidArgument, "MULTI_NODE_SINGLE_WRITER"},
		{"multi-node multi writer file system", func(r *csi.NodeStageVolumeRequest) {
			r.VolumeCapability = mountCap(csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER, "")
		}, codes.InvalidArgument, "block"},
		{"unknown access mode", func(r *csi.NodeStageVolumeRequest) {
			r.VolumeCapability = mountCap(csi.VolumeCapability_AccessMode_UNKNOWN, "")
		}, codes.InvalidArgument, "not supported"},
		{"bad fs type", func(r *csi.NodeStageVolumeRequest) { r.VolumeCapability = mountCap(rwo, "btrfs") }, codes.InvalidArgument, "btrfs"},
		{"no export", func(r *csi.NodeStageVolumeRequest) { delete(r.PublishContext, PublishContextExport) }, codes.InvalidArgument, `"export"`},
		{"no addresses", func(r *csi.NodeStageVolumeRequest) { delete(r.PublishContext, PublishContextAddresses) }, codes.InvalidArgument, `"addresses"`},
		{"bad address", func(r *csi.NodeStageVolumeRequest) { r.PublishContext[PublishContextAddresses] = "10.0.0.1" }, codes.InvalidArgument, `"addresses"`},
		{"bad transport", func(r *csi.NodeStageVolumeRequest) { r.VolumeContext[ParamTransport] = "carrier-pigeon" }, codes.InvalidArgument, "transport"},
		{"bad block size", func(r *csi.NodeStageVolumeRequest) { r.VolumeContext[ParamBlockSize] = "3" }, codes.InvalidArgument, "blockSize"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f := newNodeFixture(t)
			req := f.stageReq("pv-1", mountCap(rwo, ""))
			tt.mutate(req)
			_, err := f.node.NodeStageVolume(context.Background(), req)
			wantCode(t, err, tt.want)
			if !strings.Contains(err.Error(), tt.msg) {
				t.Errorf("error %q does not name %q", err, tt.msg)
			}
			if f.att.attaches != 0 {
				t.Errorf("attached %d times after a bad request", f.att.attaches)
			}
		})
	}
}

func TestNodeStageVolumeAttachErrors(t *testing.T) {
	tests := []struct {
		err  error
		want codes.Code
	}{
		{attach.ErrServerRefused, codes.FailedPrecondition},
		{attach.ErrUnsupported, codes.Unavailable},
		{context.DeadlineExceeded, codes.DeadlineExceeded},
		{errors.New("boom"), codes.Internal},
	}
	for _, tt := range tests {
		t.Run(tt.err.Error(), func(t *testing.T) {
			f := newNodeFixture(t)
			f.att.attachErr = tt.err
			_, err := f.node.NodeStageVolume(context.Background(), f.stageReq("pv-1", mountCap(rwo, "")))
			wantCode(t, err, tt.want)
		})
	}
}

func TestNodeStageVolumeFilesystem(t *testing.T) {
	tests := []struct {
		name       string
		capability *csi.VolumeCapability
		volCtx     map[string]string
		wantFS     string
		wantOpts   []string
		wantRO     bool
	}{
		{"param fs type", mountCap(rwo, ""), map[string]string{ParamFSType: "xfs"}, "xfs", []string{"nouuid"}, false},
		{"default ext4", mountCap(rwo, ""), nil, "ext4", nil, false},
		{"capability wins", mountCap(csi.VolumeCapability_AccessMode_SINGLE_NODE_SINGLE_WRITER, "xfs", "noatime"), map[string]string{ParamFSType: "ext4"}, "xfs", []string{"noatime", "nouuid"}, false},
		{"reader only", mountCap(csi.VolumeCapability_AccessMode_MULTI_NODE_READER_ONLY, ""), nil, "ext4", []string{"ro"}, true},
		{"single node multi writer", mountCap(csi.VolumeCapability_AccessMode_SINGLE_NODE_MULTI_WRITER, ""), nil, "ext4", nil, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f := newNodeFixture(t)
			req := f.stageReq("pv-1", tt.capability)
			req.VolumeContext = tt.volCtx
			for i := 0; i < 2; i++ {
				_, err := f.node.NodeStageVolume(context.Background(), req)
				wantCode(t, err, codes.OK)
			}
			mt, ok := f.mnt.mount(req.StagingTargetPath)
			if !ok || !mt.formatted || mt.fstype != tt.wantFS || mt.source != "/dev/fake0" || !slices.Equal(mt.options, tt.wantOpts) {
				t.Fatalf("staging mount %+v (mounted %v), want %s with %v", mt, ok, tt.wantFS, tt.wantOpts)
			}
			if f.mnt.formats != 1 {
				t.Errorf("%d formats for two stages, want 1", f.mnt.formats)
			}
			if f.att.opts["pv-1"].ReadOnly != tt.wantRO {
				t.Errorf("attach options %+v, want read-only %v", f.att.opts["pv-1"], tt.wantRO)
			}
		})
	}
}

// TestNodeStageVolumeToken: the publish context names the export alone
// (it is kept in the VolumeAttachment, readable by many); the node opens
// it with its own token, which no Kubernetes object holds. An encrypted
// volume is opened by its name with the node certificate, no token.
func TestNodeStageVolumeToken(t *testing.T) {
	f := newNodeFixture(t)
	if _, err := f.node.NodeStageVolume(context.Background(), f.stageReq("pv-1", mountCap(rwo, ""))); err != nil {
		t.Fatal(err)
	}
	if got, want := f.att.targets["pv-1"].Export, access.NodeExport("pv-1", testNodeToken); got != want {
		t.Errorf("attached export %q, want %q (the node's own token)", got, want)
	}
	n, err := NewNode(NodeConfig{NodeID: "node-1", Attacher: f.att, Mounter: f.mnt, Logger: slog.New(slog.DiscardHandler), IdentityDir: "/state/identity", Token: testNodeToken})
	if err != nil {
		t.Fatal(err)
	}
	req := f.stageReq("pv-enc", mountCap(rwo, ""))
	req.PublishContext[PublishContextStorageNode] = "store-1"
	req.VolumeContext = map[string]string{ParamEncryption: "required"}
	if _, err := n.NodeStageVolume(context.Background(), req); err != nil {
		t.Fatal(err)
	}
	if got := f.att.targets["pv-enc"]; got.Export != "pv-enc" || got.TLS == nil {
		t.Errorf("encrypted volume attached as %+v, want its name alone over TLS", got)
	}
	// Without a token of its own the node cannot open such volumes.
	n, err = NewNode(NodeConfig{NodeID: "node-1", Attacher: f.att, Mounter: f.mnt, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	_, err = n.NodeStageVolume(context.Background(), f.stageReq("pv-2", mountCap(rwo, "")))
	wantCode(t, err, codes.FailedPrecondition)
}

func TestNodeStageVolumeOptions(t *testing.T) {
	f := newNodeFixture(t)
	req := f.stageReq("pv-1", mountCap(rwo, ""))
	req.VolumeContext = map[string]string{ParamDeadConnTimeout: "60s", ParamRequestTimeout: "5s", ParamBlockSize: "512", ParamTransport: "fuse"}
	if _, err := f.node.NodeStageVolume(context.Background(), req); err != nil {
		t.Fatal(err)
	}
	o := f.att.opts["pv-1"]
	if o.DeadConnTimeout.Seconds() != 60 || o.RequestTimeout.Seconds() != 5 || o.BlockSize != 512 {
		t.Errorf("attach options %+v", o)
	}
}

func TestNodeStageVolumeFormatFailureDetaches(t *testing.T) {
	f := newNodeFixture(t)
	f.mnt.formatErr = errors.New("mkfs failed")
	_, err := f.node.NodeStageVolume(context.Background(), f.stageReq("pv-1", mountCap(rwo, "")))
	wantCode(t, err, codes.Internal)
	if f.att.isAttached("pv-1") || !slices.Equal(f.att.detaches, []string{"pv-1"}) {
		t.Errorf("volume left attached (detaches %v)", f.att.detaches)
	}
}

// TestNodeStageVolumeGrowFailureUnmounts: a stage that mounted the file
// system and then failed to grow it leaves neither the mount nor the
// attach behind, so kubelet's retry stages afresh instead of finding a
// mount of a device that is gone; an unmounted file system is offered
// for growing before it is mounted, a read-only one never.
func TestNodeStageVolumeGrowFailureUnmounts(t *testing.T) {
	f := newNodeFixture(t)
	f.mnt.resizeErr = errors.New("resize2fs: Permission denied")
	req := f.stageReq("pv-1", mountCap(rwo, ""))
	_, err := f.node.NodeStageVolume(context.Background(), req)
	wantCode(t, err, codes.Internal)
	if _, ok := f.mnt.mount(req.StagingTargetPath); ok {
		t.Error("the staging path is left mounted after the failed grow")
	}
	if f.att.isAttached("pv-1") || !slices.Equal(f.att.detaches, []string{"pv-1"}) {
		t.Errorf("volume left attached (detaches %v)", f.att.detaches)
	}
	if !slices.Equal(f.mnt.grownUnmounted, []string{"/dev/fake0"}) {
		t.Errorf("devices offered for an unmounted grow %v, want the volume's, once", f.mnt.grownUnmounted)
	}
	f.mnt.resizeErr = nil
	if _, err := f.node.NodeStageVolume(context.Background(), req); err != nil {
		t.Fatalf("retry: %v", err)
	}
	if mt, ok := f.mnt.mount(req.StagingTargetPath); !ok || mt.source != "/dev/fake0" {
		t.Errorf("retry's staging mount %+v (mounted %v)", mt, ok)
	}

	ro := newNodeFixture(t)
	if _, err := ro.node.NodeStageVolume(context.Background(), ro.stageReq("pv-2", mountCap(csi.VolumeCapability_AccessMode_MULTI_NODE_READER_ONLY, ""))); err != nil {
		t.Fatal(err)
	}
	if len(ro.mnt.grownUnmounted) != 0 || len(ro.mnt.resized) != 0 {
		t.Errorf("a read-only stage grew the file system: unmounted %v, mounted %v", ro.mnt.grownUnmounted, ro.mnt.resized)
	}
}

func TestNodeStageVolumeBlock(t *testing.T) {
	for _, mode := range []csi.VolumeCapability_AccessMode_Mode{rwo, csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER} {
		t.Run(mode.String(), func(t *testing.T) {
			f := newNodeFixture(t)
			req := f.stageReq("pv-b", blockCap(mode))
			for i := 0; i < 2; i++ {
				if _, err := f.node.NodeStageVolume(context.Background(), req); err != nil {
					t.Fatal(err)
				}
			}
			dev, err := stagedDevice(req.StagingTargetPath)
			if err != nil || dev != "/dev/fake0" {
				t.Fatalf("staged device %q, %v", dev, err)
			}
			if f.mnt.formats != 0 || len(f.mnt.mounts) != 0 {
				t.Errorf("block stage formatted or mounted: %v", f.mnt.mounts)
			}
		})
	}
}

func TestNodeContention(t *testing.T) {
	f := newNodeFixture(t)
	f.att.gate = make(chan struct{})
	f.att.entered = make(chan struct{})
	req := f.stageReq("pv-1", mountCap(rwo, ""))
	done := make(chan error)
	go func() {
		_, err := f.node.NodeStageVolume(context.Background(), req)
		done <- err
	}()
	<-f.att.entered
	_, err := f.node.NodeStageVolume(context.Background(), req)
	wantCode(t, err, codes.Aborted)
	_, err = f.node.NodeUnstageVolume(context.Background(), &csi.NodeUnstageVolumeRequest{VolumeId: "pv-1", StagingTargetPath: req.StagingTargetPath})
	wantCode(t, err, codes.Aborted)
	_, err = f.node.NodeExpandVolume(context.Background(), &csi.NodeExpandVolumeRequest{VolumeId: "pv-1", VolumePath: f.dir})
	wantCode(t, err, codes.Aborted)
	// Another volume is not held up.
	other := f.stageReq("pv-2", mountCap(rwo, ""))
	otherDone := make(chan error)
	go func() {
		_, err := f.node.NodeStageVolume(context.Background(), other)
		otherDone <- err
	}()
	<-f.att.entered
	close(f.att.gate)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if err := <-otherDone; err != nil {
		t.Fatal(err)
	}
	// The lock is released.
	f.att.gate = nil
	if _, err := f.node.NodeUnstageVolume(context.Background(), &csi.NodeUnstageVolumeRequest{VolumeId: "pv-1", StagingTargetPath: req.StagingTargetPath}); err != nil {
		t.Fatal(err)
	}
}

func TestNodeUnstageVolume(t *testing.T) {
	ctx := context.Background()
	t.Run("errors", func(t *testing.T) {
		f := newNodeFixture(t)
		_, err := f.node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{StagingTargetPath: f.dir})
		wantCode(t, err, codes.InvalidArgument)
		_, err = f.node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: "pv-1"})
		wantCode(t, err, codes.InvalidArgument)
	})
	t.Run("unknown volume", func(t *testing.T) {
		f := newNodeFixture(t)
		_, err := f.node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: "pv-x", StagingTargetPath: filepath.Join(f.dir, "missing")})
		wantCode(t, err, codes.OK)
	})
	t.Run("filesystem", func(t *testing.T) {
		f := newNodeFixture(t)
		req := f.stageReq("pv-1", mountCap(rwo, ""))
		if _, err := f.node.NodeStageVolume(ctx, req); err != nil {
			t.Fatal(err)
		}
		for i := 0; i < 2; i++ {
			_, err := f.node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: "pv-1", StagingTargetPath: req.StagingTargetPath})
			wantCode(t, err, codes.OK)
		}
		if _, ok := f.mnt.mount(req.StagingTargetPath); ok || f.att.isAttached("pv-1") {
			t.Errorf("still mounted or attached")
		}
	})
	t.Run("block", func(t *testing.T) {
		f := newNodeFixture(t)
		req := f.stageReq("pv-1", blockCap(rwo))
		if _, err := f.node.NodeStageVolume(ctx, req); err != nil {
			t.Fatal(err)
		}
		if _, err := f.node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: "pv-1", StagingTargetPath: req.StagingTargetPath}); err != nil {
			t.Fatal(err)
		}
		if _, err := os.Stat(filepath.Join(req.StagingTargetPath, deviceFile)); !os.IsNotExist(err) || f.att.isAttached("pv-1") {
			t.Errorf("device file (%v) or attach left", err)
		}
	})
	t.Run("detach fails", func(t *testing.T) {
		f := newNodeFixture(t)
		f.att.detachErr = errors.New("busy")
		_, err := f.node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: "pv-1", StagingTargetPath: f.dir})
		wantCode(t, err, codes.Internal)
	})
}

func (f *nodeFixture) publishReq(stage *csi.NodeStageVolumeRequest, target string) *csi.NodePublishVolumeRequest {
	return &csi.NodePublishVolumeRequest{
		VolumeId:          stage.VolumeId,
		StagingTargetPath: stage.StagingTargetPath,
		TargetPath:        filepath.Join(f.dir, "pods", target),
		VolumeCapability:  stage.VolumeCapability,
		PublishContext:    stage.PublishContext,
		VolumeContext:     stage.VolumeContext,
	}
}

func TestNodePublishVolumeErrors(t *testing.T) {
	tests := []struct {
		name   string
		mutate func(*csi.NodePublishVolumeRequest)
		want   codes.Code
	}{
		{"no volume id", func(r *csi.NodePublishVolumeRequest) { r.VolumeId = "" }, codes.InvalidArgument},
		{"no staging path", func(r *csi.NodePublishVolumeRequest) { r.StagingTargetPath = "" }, codes.InvalidArgument},
		{"no target path", func(r *csi.NodePublishVolumeRequest) { r.TargetPath = "" }, codes.InvalidArgument},
		{"no capability", func(r *csi.NodePublishVolumeRequest) { r.VolumeCapability = nil }, codes.InvalidArgument},
		{"bad access mode", func(r *csi.NodePublishVolumeRequest) {
			r.VolumeCapability = mountCap(csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER, "")
		}, codes.InvalidArgument},
		{"not staged", func(r *csi.NodePublishVolumeRequest) {}, codes.FailedPrecondition},
		{"block not staged", func(r *csi.NodePublishVolumeRequest) { r.VolumeCapability = blockCap(rwo) }, codes.FailedPrecondition},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f := newNodeFixture(t)
			req := f.publishReq(f.stageReq("pv-1", mountCap(rwo, "")), "t")
			tt.mutate(req)
			_, err := f.node.NodePublishVolume(context.Background(), req)
			wantCode(t, err, tt.want)
		})
	}
}

func TestNodePublishVolume(t *testing.T) {
	ctx := context.Background()
	tests := []struct {
		name       string
		capability *csi.VolumeCapability
		readonly   bool
		wantOpts   []string
	}{
		{"filesystem", mountCap(rwo, "", "noatime"), false, []string{"bind", "noatime"}},
		{"filesystem read-only", mountCap(rwo, ""), true, []string{"bind", "ro"}},
		{"filesystem reader-only mode", mountCap(csi.VolumeCapability_AccessMode_MULTI_NODE_READER_ONLY, ""), false, []string{"bind", "ro"}},
		{"block", blockCap(rwo), false, []string{"bind"}},
		{"block read-only", blockCap(csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER), true, []string{"bind", "ro"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f := newNodeFixture(t)
			stage := f.stageReq("pv-1", tt.capability)
			if _, err := f.node.NodeStageVolume(ctx, stage); err != nil {
				t.Fatal(err)
			}
			req := f.publishReq(stage, "pod-a/vol")
			req.Readonly = tt.readonly
			for i := 0; i < 2; i++ {
				_, err := f.node.NodePublishVolume(ctx, req)
				wantCode(t, err, codes.OK)
			}
			mt, ok := f.mnt.mount(req.TargetPath)
			wantSource := stage.StagingTargetPath
			if tt.capability.GetBlock() != nil {
				wantSource = "/dev/fake0"
			}
			if !ok || mt.source != wantSource || !slices.Equal(mt.options, tt.wantOpts) {
				t.Fatalf("target mount %+v (mounted %v), want %s with %v", mt, ok, wantSource, tt.wantOpts)
			}
			fi, err := os.Stat(req.TargetPath)
			if err != nil || fi.IsDir() != (tt.capability.GetBlock() == nil) {
				t.Errorf("target %v, %v", fi, err)
			}

			for i := 0; i < 2; i++ {
				_, err := f.node.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: "pv-1", TargetPath: req.TargetPath})
				wantCode(t, err, codes.OK)
			}
			if _, ok := f.mnt.mount(req.TargetPath); ok {
				t.Errorf("target still mounted")
			}
			if _, err := os.Stat(req.TargetPath); !os.IsNotExist(err) {
				t.Errorf("target left: %v", err)
			}
		})
	}
}

func TestNodeUnpublishVolumeErrors(t *testing.T) {
	f := newNodeFixture(t)
	_, err := f.node.NodeUnpublishVolume(context.Background(), &csi.NodeUnpublishVolumeRequest{TargetPath: f.dir})
	wantCode(t, err, codes.InvalidArgument)
	_, err = f.node.NodeUnpublishVolume(context.Background(), &csi.NodeUnpublishVolumeRequest{VolumeId: "pv-1"})
	wantCode(t, err, codes.InvalidArgument)
}

func TestNodePublishContention(t *testing.T) {
	f := newNodeFixture(t)
	stage := f.stageReq("pv-1", mountCap(rwo, ""))
	req := f.publishReq(stage, "t")
	target := req.TargetPath
	unlock, ok := f.node.lock("pv-1\x00" + target)
	if !ok {
		t.Fatal("lock")
	}
	defer unlock()
	_, err := f.node.NodePublishVolume(context.Background(), req)
	wantCode(t, err, codes.Aborted)
	_, err = f.node.NodeUnpublishVolume(context.Background(), &csi.NodeUnpublishVolumeRequest{VolumeId: "pv-1", TargetPath: target})
	wantCode(t, err, codes.Aborted)
}

func TestNodeGetVolumeStats(t *testing.T) {
	ctx := context.Background()
	f := newNodeFixture(t)
	stage := f.stageReq("pv-1", mountCap(rwo, ""))
	if _, err := f.node.NodeStageVolume(ctx, stage); err != nil {
		t.Fatal(err)
	}
	f.mnt.stats = FSStats{TotalBytes: 1000, AvailableBytes: 600, UsedBytes: 400, TotalInodes: 10, FreeInodes: 7, UsedInodes: 3}
	blockPath := filepath.Join(f.dir, "blockdev")
	if err := os.WriteFile(blockPath, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	f.mnt.blockDevs[blockPath] = 4096

	t.Run("errors", func(t *testing.T) {
		_, err := f.node.NodeGetVolumeStats(ctx, &csi.NodeGetVolumeStatsRequest{VolumePath: f.dir})
		wantCode(t, err, codes.InvalidArgument)
		_, err = f.node.NodeGetVolumeStats(ctx, &csi.NodeGetVolumeStatsRequest{VolumeId: "pv-1"})
		wantCode(t, err, codes.InvalidArgument)
		_, err = f.node.NodeGetVolumeStats(ctx, &csi.NodeGetVolumeStatsRequest{VolumeId: "pv-1", VolumePath: filepath.Join(f.dir, "missing")})
		wantCode(t, err, codes.NotFound)
		_, err = f.node.NodeGetVolumeStats(ctx, &csi.NodeGetVolumeStatsRequest{VolumeId: "pv-1", VolumePath: f.dir})
		wantCode(t, err, codes.NotFound)
	})
	t.Run("filesystem", func(t *testing.T) {
		resp, err := f.node.NodeGetVolumeStats(ctx, &csi.NodeGetVolumeStatsRequest{VolumeId: "pv-1", VolumePath: stage.StagingTargetPath})
		if err != nil {
			t.Fatal(err)
		}
		u := resp.GetUsage()
		if len(u) != 2 || u[0].Unit != csi.VolumeUsage_BYTES || u[0].Used != 400 || u[0].Total != 1000 || u[0].Available != 600 ||
			u[1].Unit != csi.VolumeUsage_INODES || u[1].Used != 3 || u[1].Available != 7 {
			t.Errorf("usage %v", u)
		}
	})
	t.Run("block", func(t *testing.T) {
		resp, err := f.node.NodeGetVolumeStats(ctx, &csi.NodeGetVolumeStatsRequest{VolumeId: "pv-1", VolumePath: blockPath})
		if err != nil {
			t.Fatal(err)
		}
		if u := resp.GetUsage(); len(u) != 1 || u[0].Total != 4096 || u[0].Unit != csi.VolumeUsage_BYTES {
			t.Errorf("usage %v", u)
		}
	})

	conditions := []struct {
		name   string
		id     string
		health *attach.Health
		status csi.VolumeHealthErrorType // UNKNOWN: healthy, no entry
		reason string
		msg    string
	}{
		{"healthy", "pv-1", &attach.Health{Connected: true, MPTCP: true, Subflows: []int{2}}, 0, "", ""},
		{"disconnected", "pv-1", &attach.Health{Connected: false, Message: "connection reset"}, csi.VolumeHealthErrorType_INACCESSIBLE, HealthDisconnected, "connection reset"},
		{"too few subflows", "pv-1", &attach.Health{Connected: true, MPTCP: true, Subflows: []int{2, 1}}, csi.VolumeHealthErrorType_DEGRADED, HealthMissingSubflows, "1 MPTCP subflows, want 2"},
		{"plain TCP", "pv-1", &attach.Health{Connected: true, Subflows: []int{1}}, 0, "", ""},
		{"not attached", "pv-other", nil, csi.VolumeHealthErrorType_INACCESSIBLE, HealthNotAttached, "not attached"},
	}
	for _, c := range conditions {
		t.Run("condition "+c.name, func(t *testing.T) {
			if c.health != nil {
				f.att.mu.Lock()
				f.att.health[c.id] = *c.health
				f.att.mu.Unlock()
			}
			resp, err := f.node.NodeGetVolumeHealth(ctx, &csi.NodeGetVolumeHealthRequest{VolumeId: c.id, StagingTargetPath: stage.StagingTargetPath})
			if err != nil {
				t.Fatal(err)
			}
			vh := resp.GetVolumeHealth()
			if vh.GetVolumeId() != c.id {
				t.Errorf("health of %q, want %q", vh.GetVolumeId(), c.id)
			}
			entries := vh.GetHealthStatuses()
			if c.status == 0 {
				if len(entries) != 0 {
					t.Errorf("health %v, want none", entries)
				}
				return
			}
			if len(entries) != 1 || entries[0].Status != c.status || entries[0].Reason != c.reason || !strings.Contains(entries[0].Message, c.msg) {
				t.Errorf("health %v, want %s %s with %q", entries, c.status, c.reason, c.msg)
			}
		})
	}
}

// TestNodeExpectedSubflowsAfterRestart: a node plugin restarted with the
// same StateDir still knows how many subflows a staged volume should
// have and reports one missing them as DEGRADED; after the unstage the
// count is gone.
func TestNodeExpectedSubflowsAfterRestart(t *testing.T) {
	ctx := context.Background()
	f := newNodeFixture(t)
	state := t.TempDir()
	node := func() *Node {
		n, err := NewNode(NodeConfig{NodeID: "node-1", Attacher: f.att, Mounter: f.mnt, Logger: slog.New(slog.DiscardHandler), StateDir: state, Token: testNodeToken})
		if err != nil {
			t.Fatal(err)
		}
		return n
	}
	stage := f.stageReq("pv-1", mountCap(rwo, ""))
	stage.PublishContext[PublishContextStorageNode] = "storage-1"
	stage.VolumeContext[VolumeContextPVCName] = "data"
	stage.VolumeContext[VolumeContextPVCNamespace] = "apps"
	if _, err := node().NodeStageVolume(ctx, stage); err != nil {
		t.Fatal(err)
	}
	want := len(strings.Split(stage.PublishContext[PublishContextAddresses], ","))
	// The storage node, the claim and the device too (the metrics'
	// mpnbd_node_volume_info).
	wantFacts := stagedFacts{addrs: want, storageNode: "storage-1", volumeInfo: volumeInfo{PVC: "data", Namespace: "apps", Device: "fake0"}}
	if facts, ok := node().staged("pv-1"); !ok || facts != wantFacts {
		t.Errorf("after a restart: %+v, %v; want %+v", facts, ok, wantFacts)
	}
	// A malformed info file costs the claim and device, not the count.
	info := filepath.Join(state, infoDir, "pv-1")
	good, err := os.ReadFile(info)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(info, []byte("{"), 0o600); err != nil {
		t.Fatal(err)
	}
	if facts, ok := node().staged("pv-1"); !ok || facts != (stagedFacts{addrs: want, storageNode: "storage-1"}) {
		t.Errorf("with a malformed info file: %+v, %v", facts, ok)
	}
	if err := os.WriteFile(info, good, 0o600); err != nil {
		t.Fatal(err)
	}
	// A file an earlier plugin wrote holds the count alone.
	if err := os.WriteFile(filepath.Join(state, expectedDir, "pv-old"), []byte("3\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if facts, ok := node().staged("pv-old"); !ok || facts != (stagedFacts{addrs: 3}) {
		t.Errorf("an earlier plugin's count: %+v, %v", facts, ok)
	}
	for _, bad := range []string{"", "x storage-1", "0", "2 a b"} {
		if err := os.WriteFile(filepath.Join(state, expectedDir, "pv-bad"), []byte(bad), 0o600); err != nil {
			t.Fatal(err)
		}
		if facts, ok := node().staged("pv-bad"); ok {
			t.Errorf("%q read as %+v", bad, facts)
		}
	}
	os.Remove(filepath.Join(state, expectedDir, "pv-bad"))
	os.Remove(filepath.Join(state, expectedDir, "pv-old"))
	f.att.mu.Lock()
	f.att.health["pv-1"] = attach.Health{Connected: true, MPTCP: true, Subflows: []int{want - 1}}
	f.att.mu.Unlock()
	restarted := node()
	resp, err := restarted.NodeGetVolumeHealth(ctx, &csi.NodeGetVolumeHealthRequest{VolumeId: "pv-1", StagingTargetPath: stage.StagingTargetPath})
	if err != nil {
		t.Fatal(err)
	}
	if e := resp.GetVolumeHealth().GetHealthStatuses(); len(e) != 1 || e[0].Reason != HealthMissingSubflows ||
		!strings.Contains(e[0].Message, fmt.Sprintf("want %d", want)) {
		t.Fatalf("after a restart, health %v; want %s (want %d)", e, HealthMissingSubflows, want)
	}
	if _, err := restarted.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: "pv-1", StagingTargetPath: stage.StagingTargetPath}); err != nil {
		t.Fatal(err)
	}
	for _, d := range []string{expectedDir, infoDir} {
		if left, _ := os.ReadDir(filepath.Join(state, d)); len(left) != 0 {
			t.Errorf("after the unstage, %s holds %d files", d, len(left))
		}
	}
	if _, ok := node().expectedSubflows("pv-1"); ok {
		t.Error("a node started after the unstage still knows the volume's subflows")
	}
}

func TestNodeExpandVolume(t *testing.T) {
	ctx := context.Background()
	f := newNodeFixture(t)
	stage := f.stageReq("pv-1", mountCap(rwo, ""))
	if _, err := f.node.NodeStageVolume(ctx, stage); err != nil {
		t.Fatal(err)
	}
	f.mnt.blockDevs["/dev/fake0"] = 2 << 30
	blockPath := filepath.Join(f.dir, "blockdev")
	if err := os.WriteFile(blockPath, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	f.mnt.blockDevs[blockPath] = 3 << 30
	f.att.exportSize = map[string]uint64{"pv-1": 3 << 30}

	tests := []struct {
		name       string
		req        *csi.NodeExpandVolumeRequest
		want       codes.Code
		wantBytes  int64
		wantResize bool
	}{
		{"no volume id", &csi.NodeExpandVolumeRequest{VolumePath: f.dir}, codes.InvalidArgument, 0, false},
		{"no volume path", &csi.NodeExpandVolumeRequest{VolumeId: "pv-1"}, codes.InvalidArgument, 0, false},
		{"bad capability", &csi.NodeExpandVolumeRequest{VolumeId: "pv-1", VolumePath: f.dir, VolumeCapability: mountCap(csi.VolumeCapability_AccessMode_MULTI_NODE_SINGLE_WRITER, "")}, codes.InvalidArgument, 0, false},
		{"missing path", &csi.NodeExpandVolumeRequest{VolumeId: "pv-1", VolumePath: filepath.Join(f.dir, "missing")}, codes.NotFound, 0, false},
		{"block", &csi.NodeExpandVolumeRequest{VolumeId: "pv-1", VolumePath: blockPath, VolumeCapability: blockCap(rwo)}, codes.OK, 3 << 30, false},
		{"filesystem", &csi.NodeExpandVolumeRequest{VolumeId: "pv-1", VolumePath: stage.StagingTargetPath, CapacityRange: &csi.CapacityRange{RequiredBytes: 2 << 30}}, codes.OK, 2 << 30, true},
		{"export not grown yet", &csi.NodeExpandVolumeRequest{VolumeId: "pv-1", VolumePath: stage.StagingTargetPath, CapacityRange: &csi.CapacityRange{RequiredBytes: 4 << 30}}, codes.Unavailable, 0, false},
		{"device not grown", &csi.NodeExpandVolumeRequest{VolumeId: "pv-1", VolumePath: stage.StagingTargetPath, CapacityRange: &csi.CapacityRange{RequiredBytes: 3 << 30}}, codes.Unavailable, 0, false},
		{"not mounted", &csi.NodeExpandVolumeRequest{VolumeId: "pv-1", VolumePath: f.dir}, codes.NotFound, 0, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f.mnt.resized = nil
			resp, err := f.node.NodeExpandVolume(ctx, tt.req)
			wantCode(t, err, tt.want)
			if resp.GetCapacityBytes() != tt.wantBytes {
				t.Errorf("capacity %d, want %d", resp.GetCapacityBytes(), tt.wantBytes)
			}
			if got := len(f.mnt.resized) > 0; got != tt.wantResize {
				t.Errorf("resized %v, want %v", f.mnt.resized, tt.wantResize)
			}
		})
	}
}

func TestNodeGetInfoAndCapabilities(t *testing.T) {
	f := newNodeFixture(t)
	info, err := f.node.NodeGetInfo(context.Background(), &csi.NodeGetInfoRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if info.NodeId != "node-1" || info.MaxVolumesPerNode != 16 || info.GetAccessibleTopology().GetSegments()["topology.mpnbd.io/zone"] != "a" {
		t.Errorf("info %v", info)
	}
	caps, err := f.node.NodeGetCapabilities(context.Background(), &csi.NodeGetCapabilitiesRequest{})
	if err != nil {
		t.Fatal(err)
	}
	var got []csi.NodeServiceCapability_RPC_Type
	for _, c := range caps.Capabilities {
		got = append(got, c.GetRpc().GetType())
	}
	for _, want := range []csi.NodeServiceCapability_RPC_Type{
		csi.NodeServiceCapability_RPC_STAGE_UNSTAGE_VOLUME,
		csi.NodeServiceCapability_RPC_GET_VOLUME_STATS,
		csi.NodeServiceCapability_RPC_EXPAND_VOLUME,
		csi.NodeServiceCapability_RPC_GET_VOLUME_HEALTH,
		csi.NodeServiceCapability_RPC_SINGLE_NODE_MULTI_WRITER,
	} {
		if !slices.Contains(got, want) {
			t.Errorf("capability %s missing", want)
		}
	}
}

func TestNewNode(t *testing.T) {
	if _, err := NewNode(NodeConfig{Attacher: newFakeAttacher(), Mounter: newFakeMounter()}); !errors.Is(err, ErrInvalidArgument) {
		t.Errorf("no node ID: %v", err)
	}
	if _, err := NewNode(NodeConfig{NodeID: "n"}); !errors.Is(err, ErrInvalidArgument) {
		t.Errorf("no attacher: %v", err)
	}
}

func TestNodeGetVolumeHealthArguments(t *testing.T) {
	f := newNodeFixture(t)
	_, err := f.node.NodeGetVolumeHealth(context.Background(), &csi.NodeGetVolumeHealthRequest{})
	wantCode(t, err, codes.InvalidArgument)
	_, err = f.node.NodeGetVolumeHealth(context.Background(), &csi.NodeGetVolumeHealthRequest{VolumeId: "pv-1", VolumePublishPath: filepath.Join(f.dir, "missing")})
	wantCode(t, err, codes.NotFound)
}

func TestNodePublishSingleWriter(t *testing.T) {
	ctx := context.Background()
	f := newNodeFixture(t)
	snsw := mountCap(csi.VolumeCapability_AccessMode_SINGLE_NODE_SINGLE_WRITER, "")
	stage := f.stageReq("pv-1", snsw)
	if _, err := f.node.NodeStageVolume(ctx, stage); err != nil {
		t.Fatal(err)
	}
	first := f.publishReq(stage, "pod-a/vol")
	if _, err := f.node.NodePublishVolume(ctx, first); err != nil {
		t.Fatal(err)
	}
	if _, err := f.node.NodePublishVolume(ctx, first); err != nil {
		t.Fatalf("repeated publish to the same target: %v", err)
	}
	second := f.publishReq(stage, "pod-b/vol")
	_, err := f.node.NodePublishVolume(ctx, second)
	wantCode(t, err, codes.FailedPrecondition)
	if _, ok := f.mnt.mount(second.TargetPath); ok {
		t.Error("the refused target is mounted")
	}
	// A single-node multi-writer volume may be published twice.
	snmw := mountCap(csi.VolumeCapability_AccessMode_SINGLE_NODE_MULTI_WRITER, "")
	stage2 := f.stageReq("pv-2", snmw)
	if _, err := f.node.NodeStageVolume(ctx, stage2); err != nil {
		t.Fatal(err)
	}
	for _, target := range []string{"pod-c/vol", "pod-d/vol"} {
		if _, err := f.node.NodePublishVolume(ctx, f.publishReq(stage2, target)); err != nil {
			t.Fatalf("multi-writer publish to %s: %v", target, err)
		}
	}
	// Once the first target is gone, the single writer may move.
	if _, err := f.node.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: "pv-1", TargetPath: first.TargetPath}); err != nil {
		t.Fatal(err)
	}
	if _, err := f.node.NodePublishVolume(ctx, second); err != nil {
		t.Fatalf("publish after the other target was unpublished: %v", err)
	}
}
