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

package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/container-storage-interface/spec/lib/go/csi"

	"github.com/mpnbd/mpnbd/pkg/driver"
)

// csiVolume is a volume as the CO holds it between its CSI calls.
type csiVolume struct {
	id     string
	cap    *csi.VolumeCapability
	volCtx map[string]string
	pubCtx map[string]string
	// staging and target are set once the volume is staged and
	// published on the worker.
	staging, target string
}

// mountCapability asks for a file system volume of fsType.
func mountCapability(fsType string) *csi.VolumeCapability {
	return &csi.VolumeCapability{
		AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{FsType: fsType}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER},
	}
}

// blockCapability asks for a raw block volume.
func blockCapability() *csi.VolumeCapability {
	return &csi.VolumeCapability{
		AccessType: &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER},
	}
}

// kind names what a capability asks for: its file system, or "block".
func kind(vc *csi.VolumeCapability) string {
	if vc.GetBlock() != nil {
		return "block"
	}
	return vc.GetMount().GetFsType()
}

// createVolume creates a volume of size bytes named name and publishes it
// to the worker, as two steps (note, if any, ends the first one's title).
// DeleteVolume and ControllerUnpublishVolume go onto the teardown.
func (d *demo) createVolume(ctx context.Context, cc *csiClients, name string, size int64, vc *csi.VolumeCapability, note string) (*csiVolume, error) {
	o := d.o
	params := map[string]string{driver.ParamTransport: o.transport}
	if vc.GetMount() != nil {
		params[driver.ParamFSType] = kind(vc)
	}
	title := fmt.Sprintf("CreateVolume %s, %s, transport=%s", formatBytes(size), kind(vc), o.transport)
	if note != "" {
		title += ": " + note
	}
	v := &csiVolume{cap: vc}
	if err := d.step(title, func() error {
		r, err := cc.ctrl.CreateVolume(ctx, &csi.CreateVolumeRequest{
			Name:               name,
			CapacityRange:      &csi.CapacityRange{RequiredBytes: size},
			VolumeCapabilities: []*csi.VolumeCapability{vc},
			Parameters:         params,
		})
		if err != nil {
			return err
		}
		vol := r.GetVolume()
		id := vol.GetVolumeId()
		v.id, v.volCtx = id, vol.GetVolumeContext()
		d.onCleanup("DeleteVolume, wait for the backing file to go", func(ctx context.Context) error {
			if _, err := cc.ctrl.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: id}); err != nil {
				return err
			}
			backing := filepath.Join(d.dir, "volumes", id+".img")
			return waitFor(ctx, "the backing file "+backing+" to be removed", readyTimeout, func() error {
				if _, err := os.Stat(backing); err == nil {
					return errors.New("still there")
				}
				return nil
			})
		})
		fmt.Fprintf(d.out, "     volume %s, %d bytes, context %v\n", id, vol.GetCapacityBytes(), v.volCtx)
		return nil
	}); err != nil {
		return nil, err
	}

	if err := d.step("ControllerPublishVolume to "+workerNode, func() error {
		r, err := cc.ctrl.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{
			VolumeId: v.id, NodeId: workerNode, VolumeCapability: vc, VolumeContext: v.volCtx,
		})
		if err != nil {
			return err
		}
		d.onCleanup("ControllerUnpublishVolume", func(ctx context.Context) error {
			_, err := cc.ctrl.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: v.id, NodeId: workerNode})
			return err
		})
		v.pubCtx = r.GetPublishContext()
		fmt.Fprintf(d.out, "     export %s at %s\n", maskedExport(v.pubCtx[driver.PublishContextExport]), v.pubCtx[driver.PublishContextAddresses])
		return nil
	}); err != nil {
		return nil, err
	}
	return v, nil
}

// maskedExport hides the access token of an export name (volume/token).
func maskedExport(export string) string {
	if vol, tok, ok := strings.Cut(export, "/"); ok {
		return vol + "/" + strings.Repeat("*", len(tok))
	}
	return export
}

// stageVolume stages the volume on the worker and publishes it at
// target, as two steps; NodeUnstageVolume and NodeUnpublishVolume go onto
// the teardown.
func (d *demo) stageVolume(ctx context.Context, cc *csiClients, v *csiVolume, target string) error {
	staging := filepath.Join(d.dir, "kubelet", "staging", v.id)
	what := "connect over MPTCP, attach, mkfs, mount"
	if v.cap.GetBlock() != nil {
		what = "connect over MPTCP, attach"
	}
	if err := d.step("NodeStageVolume ("+what+")", func() error {
		if err := os.MkdirAll(staging, 0o750); err != nil {
			return err
		}
		_, err := cc.node.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{
			VolumeId: v.id, PublishContext: v.pubCtx, StagingTargetPath: staging, VolumeCapability: v.cap,
			VolumeContext: v.volCtx,
		})
		// Unstage also after a failed stage: it removes what is left.
		d.onCleanup("NodeUnstageVolume", func(ctx context.Context) error {
			_, err := cc.node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: v.id, StagingTargetPath: staging})
			return err
		})
		if err != nil {
			return err
		}
		v.staging = staging
		fmt.Fprintf(d.out, "     %s: %s\n", staging, mountOf(staging))
		return nil
	}); err != nil {
		return err
	}
	return d.step("NodePublishVolume", func() error {
		// A Block volume's target is a file the node plugin makes, a
		// file system's a directory.
		if err := os.MkdirAll(filepath.Dir(target), 0o750); err != nil {
			return err
		}
		_, err := cc.node.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{
			VolumeId: v.id, PublishContext: v.pubCtx, StagingTargetPath: staging, TargetPath: target,
			VolumeCapability: v.cap, VolumeContext: v.volCtx,
		})
		d.onCleanup("NodeUnpublishVolume", func(ctx context.Context) error {
			_, err := cc.node.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: v.id, TargetPath: target})
			return err
		})
		if err != nil {
			return err
		}
		v.target = target
		fmt.Fprintf(d.out, "     %s: %s\n", target, mountOf(target))
		return nil
	})
}

// tearDown undoes, as one step, what was set up since the teardown held
// mark entries: for a volume, NodeUnpublish, NodeUnstage,
// ControllerUnpublish and DeleteVolume. It fails when a mount or a loop
// device is left in the work directory.
func (d *demo) tearDown(title string, mark int) error {
	return d.step(title, func() error {
		if err := d.unwind(mark, "     "); err != nil {
			return err
		}
		if left := leftovers(d.dir, nil); len(left) > 0 {
			return fmt.Errorf("left behind: %s", strings.Join(left, "; "))
		}
		return nil
	})
}
