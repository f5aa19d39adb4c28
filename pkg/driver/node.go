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
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"

	"github.com/container-storage-interface/spec/lib/go/csi"

	"github.com/mpnbd/mpnbd/pkg/attach"
)

// Attacher is the part of *attach.Manager the node service uses.
type Attacher interface {
	Attach(ctx context.Context, tr attach.Transport, t attach.Target, o attach.Options) (*attach.Attachment, error)
	Detach(ctx context.Context, volumeID string) error
	Health(volumeID string) (attach.Transport, attach.Health, error)
	Resize(ctx context.Context, volumeID string, newSize uint64) (uint64, error)
}

var _ Attacher = (*attach.Manager)(nil)

// FSStats is the usage of a mounted file system.
type FSStats struct {
	TotalBytes, AvailableBytes, UsedBytes int64
	TotalInodes, FreeInodes, UsedInodes   int64
}

// Mounter is every mount and file-system effect of the node service.
// NewMounter returns the real one.
type Mounter interface {
	// FormatAndMount formats source with fstype unless it already holds
	// a file system, then mounts it at target.
	FormatAndMount(source, target, fstype string, options []string) error
	// Mount mounts source at target; with the "bind" option a bind mount.
	Mount(source, target, fstype string, options []string) error
	Unmount(target string) error
	// IsMountPoint reports whether path is a mount point (bind mounts of
	// files included); it returns an fs.ErrNotExist error when path is
	// missing.
	IsMountPoint(path string) (bool, error)
	PathExists(path string) (bool, error)
	// MakeDir creates a directory and its parents.
	MakeDir(path string) error
	// MakeFile creates an empty file unless it exists.
	MakeFile(path string) error
	// IsBlockDevice reports whether path is a block device node.
	IsBlockDevice(path string) (bool, error)
	// GetDeviceSize returns the size of a block device in bytes.
	GetDeviceSize(path string) (uint64, error)
	// DeviceFromMount returns the device mounted at mountPath.
	DeviceFromMount(mountPath string) (string, error)
	// Resize grows the file system on devicePath, mounted at mountPath,
	// to the size of the device; false when it has that size already.
	Resize(devicePath, mountPath string) (bool, error)
	// GrowUnmounted grows an unmounted ext2/3/4 file system on
	// devicePath to the size of the device, checking it first; false
	// when the device holds no such file system or it has that size
	// already. (Growing ext4 while mounted needs CAP_SYS_RESOURCE, and
	// a restored file system needs its journal replayed anyway.)
	GrowUnmounted(devicePath string) (bool, error)
	// Statfs reports the usage of the file system holding path.
	Statfs(path string) (FSStats, error)
}

// NodeConfig configures a Node.
type NodeConfig struct {
	NodeID string
	// Topology is the node's accessible topology segments.
	Topology map[string]string
	// MaxVolumes is the most volumes the node takes (0: no limit).
	MaxVolumes int64
	Attacher   Attacher
	Mounter    Mounter
	Logger     *slog.Logger
	// Observer, when set, hears of every volume staged and unstaged (to
	// tell the user: *VolumeWatch).
	Observer StageObserver
	// StateDir keeps, per staged volume, how many storage addresses it
	// was staged with, so that a restarted node plugin still tells a
	// volume missing subflows (in the directory expectedDir names). Empty:
	// remembered in memory only, and unknown after a restart.
	StateDir string
	// IdentityDir holds the node's certificate and the CA bundle
	// (nodeid.Identity), with which encrypted volumes are opened. Empty:
	// no certificate, and volumes whose encryption is required fail to
	// stage.
	IdentityDir string
	// Token is the node's token (access.LoadOrCreateToken), which opens
	// the volumes without encryption: the controller hands it to no one.
	// Empty: such volumes fail to stage.
	Token string
}

// expectedDir is the directory under NodeConfig.StateDir holding, per
// staged volume, a file named by its ID with its storage address count
// and, after a space, its storage node ("4 storage-1"; a file of an
// earlier plugin holds the count alone).
const expectedDir = "expected-subflows"

// stagedFacts is what the node keeps of a staged volume beyond its
// attachment: how many storage addresses it was published with (the
// MPTCP subflows a healthy connection has) and the storage node serving
// it (for the metrics: mpnbd_node_volume_info).
type stagedFacts struct {
	addrs       int
	storageNode string
	volumeInfo
}

// volumeInfo is what the node's metrics say of a staged volume besides
// its storage node: the claim it was made for (empty when the controller
// did not say) and its block device's name ("loop3", "nbd0": the device
// label of node_exporter's disk metrics). Kept in StateDir under infoDir,
// as JSON, beside the address count (an earlier plugin reads that file
// and ignores this one).
type volumeInfo struct {
	PVC       string `json:"pvc,omitempty"`
	Namespace string `json:"namespace,omitempty"`
	Device    string `json:"device,omitempty"`
}

// infoDir is the directory under NodeConfig.StateDir holding, per staged
// volume, its volumeInfo.
const infoDir = "volume-info"

// newVolumeInfo is the volumeInfo of a volume staged on device, from its
// volume context; values that are no label-safe name are left out.
func newVolumeInfo(volumeCtx map[string]string, device string) volumeInfo {
	name := func(s string) string {
		s = strings.TrimSpace(s)
		if len(s) > 253 || strings.ContainsFunc(s, func(r rune) bool { return r <= ' ' || r == '"' || r == '\\' || r > '~' }) {
			return ""
		}
		return s
	}
	dev := ""
	if device != "" {
		dev = name(filepath.Base(device))
	}
	return volumeInfo{PVC: name(volumeCtx[VolumeContextPVCName]), Namespace: name(volumeCtx[VolumeContextPVCNamespace]), Device: dev}
}

// StageObserver hears of the volumes the node stages and unstages. Its
// methods return at once: a CSI call never waits for what it does.
type StageObserver interface {
	// Staged: the volume is attached and staged; att.Choice says how its
	// transport was chosen when this stage attached it.
	Staged(att *attach.Attachment)
	Unstaged(volumeID string)
}

// Node serves the CSI Node service.
type Node struct {
	csi.UnimplementedNodeServer

	cfg NodeConfig
	log *slog.Logger

	// inFlight holds the keys of running mutating calls (volume IDs, or
	// volume ID and target path for publish), for the per-volume
	// try-lock.
	inFlight sync.Map
	// pubMu guards pubs: per volume, the target paths this process
	// published it to, for the single-writer check.
	pubMu sync.Mutex
	pubs  map[string]map[string]bool
	// addrs remembers, per staged volume, its stagedFacts: how many
	// storage addresses it was published with (the MPTCP subflows a
	// healthy volume has) and its storage node. Kept in StateDir too;
	// without one it is lost with the process, after which only
	// connectivity is checked.
	addrs sync.Map
}

// deviceFile is the file in a Block volume's staging directory naming
// its device, for NodePublishVolume.
const deviceFile = "device"

// NewNode returns a node service.
func NewNode(c NodeConfig) (*Node, error) {
	if c.NodeID == "" {
		return nil, fmt.Errorf("%w: node ID is required", ErrInvalidArgument)
	}
	if c.Attacher == nil || c.Mounter == nil {
		return nil, fmt.Errorf("%w: attacher and mounter are required", ErrInvalidArgument)
	}
	log := c.Logger
	if log == nil {
		log = slog.Default()
	}
	return &Node{cfg: c, log: log, pubs: make(map[string]map[string]bool)}, nil
}

var _ csi.NodeServer = (*Node)(nil)

// lock takes the try-lock of key; ok is false when a call holds it.
func (n *Node) lock(key string) (unlock func(), ok bool) {
	if _, busy := n.inFlight.LoadOrStore(key, struct{}{}); busy {
		return nil, false
	}
	return func() { n.inFlight.Delete(key) }, true
}

func aborted(what, id string) error {
	return toStatus(fmt.Errorf("%w: %s of volume %s", ErrAborted, what, id))
}

func invalid(format string, args ...any) error {
	return toStatus(fmt.Errorf("%w: "+format, append([]any{ErrInvalidArgument}, args...)...))
}

// checkCapability validates a volume capability for this node.
func checkCapability(c *csi.VolumeCapability) error {
	if c == nil {
		return invalid("volume_capability is required")
	}
	block := c.GetBlock() != nil
	if !block && c.GetMount() == nil {
		return invalid("volume_capability needs an access type (block or mount)")
	}
	if c.GetAccessMode() == nil {
		return invalid("volume_capability needs an access mode")
	}
	switch m := c.GetAccessMode().GetMode(); m {
	case csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER,
		csi.VolumeCapability_AccessMode_SINGLE_NODE_SINGLE_WRITER,
		csi.VolumeCapability_AccessMode_SINGLE_NODE_MULTI_WRITER,
		csi.VolumeCapability_AccessMode_MULTI_NODE_READER_ONLY:
	case csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER:
		if !block {
			return invalid("access mode %s needs a block volume", m)
		}
	default:
		return invalid("access mode %s is not supported", m)
	}
	if t := c.GetMount().GetFsType(); t != "" && t != "ext4" && t != "xfs" {
		return invalid("fs_type %q is not supported (want ext4 or xfs)", t)
	}
	return nil
}

func readOnlyMode(c *csi.VolumeCapability) bool {
	return c.GetAccessMode().GetMode() == csi.VolumeCapability_AccessMode_MULTI_NODE_READER_ONLY
}

func (n *Node) NodeStageVolume(ctx context.Context, req *csi.NodeStageVolumeRequest) (*csi.NodeStageVolumeResponse, error) {
	id, staging := req.GetVolumeId(), req.GetStagingTargetPath()
	if id == "" {
		return nil, invalid("volume_id is required")
	}
	if staging == "" {
		return nil, invalid("staging_target_path is required")
	}
	capability := req.GetVolumeCapability()
	if err := checkCapability(capability); err != nil {
		return nil, err
	}
	spec, err := parseAttachSpec(id, req.GetPublishContext(), req.GetVolumeContext(), n.cfg.IdentityDir, n.cfg.Token)
	if err != nil {
		return nil, toStatus(err)
	}
	spec.Options.ReadOnly = readOnlyMode(capability)
	unlock, ok := n.lock(id)
	if !ok {
		return nil, aborted("stage", id)
	}
	defer unlock()

	att, err := n.stage(ctx, id, staging, capability, spec)
	if err != nil {
		return nil, toStatus(err)
	}
	n.rememberExpected(id, stagedFacts{addrs: len(spec.Target.Addrs), storageNode: strings.TrimSpace(req.GetPublishContext()[PublishContextStorageNode]),
		volumeInfo: newVolumeInfo(req.GetVolumeContext(), att.Device)})
	if n.cfg.Observer != nil {
		n.cfg.Observer.Staged(att)
	}
	return &csi.NodeStageVolumeResponse{}, nil
}

func (n *Node) stage(ctx context.Context, id, staging string, c *csi.VolumeCapability, spec attachSpec) (*attach.Attachment, error) {
	log := n.log.With("volume_id", id, "staging_target_path", staging)
	att, err := n.cfg.Attacher.Attach(ctx, spec.Transport, spec.Target, spec.Options)
	if err != nil {
		return nil, fmt.Errorf("attach volume %s: %w", id, err)
	}
	if err := n.mountStaged(ctx, log, id, staging, c, spec, att); err != nil {
		return nil, err
	}
	return att, nil
}

// mountStaged makes the staging path of an attached volume: the device's
// name (Block) or its file system mounted there.
func (n *Node) mountStaged(ctx context.Context, log *slog.Logger, id, staging string, c *csi.VolumeCapability, spec attachSpec, att *attach.Attachment) error {
	log = log.With("device", att.Device, "transport", string(att.Transport))
	// undo detaches after a failed stage, so that no attach is left
	// without a staging path that kubelet would unstage.
	undo := func(cause error) error {
		if derr := n.cfg.Attacher.Detach(context.WithoutCancel(ctx), id); derr != nil {
			log.Error("detach after failed stage", "error", derr)
			return errors.Join(cause, fmt.Errorf("detach: %w", derr))
		}
		return cause
	}
	if err := n.cfg.Mounter.MakeDir(staging); err != nil {
		return undo(fmt.Errorf("create staging path: %w", err))
	}
	if c.GetBlock() != nil {
		if err := attach.WriteFileAtomic(filepath.Join(staging, deviceFile), []byte(att.Device+"\n")); err != nil {
			return undo(fmt.Errorf("record device: %w", err))
		}
		log.Info("block volume staged")
		return nil
	}
	mounted, err := n.cfg.Mounter.IsMountPoint(staging)
	if err != nil {
		return undo(fmt.Errorf("check staging path: %w", err))
	}
	if mounted {
		return nil
	}
	fsType := spec.FSType
	if t := c.GetMount().GetFsType(); t != "" {
		fsType = t
	}
	opts := slices.Clone(c.GetMount().GetMountFlags())
	if spec.Options.ReadOnly {
		opts = append(opts, "ro")
	}
	if fsType == "xfs" && !slices.Contains(opts, "nouuid") {
		// A clone or restore holds its source's file system, UUID and
		// all, and xfs refuses to mount a second file system of one UUID
		// on a node (a pod using a volume and its clone).
		opts = append(opts, "nouuid")
	}
	// A volume restored or cloned into more space than its source had
	// holds the source's smaller file system: grow it to the device, ext
	// file systems before they are mounted, the others (xfs grows only
	// mounted) after.
	if !spec.Options.ReadOnly {
		grown, err := n.cfg.Mounter.GrowUnmounted(att.Device)
		if err != nil {
			return undo(fmt.Errorf("grow the filesystem on %s to the volume's size: %w", att.Device, err))
		}
		if grown {
			log.Info("filesystem grown to the volume's size at stage")
		}
	}
	if err := n.cfg.Mounter.FormatAndMount(att.Device, staging, fsType, opts); err != nil {
		return undo(fmt.Errorf("format and mount %s (%s) at %s: %w", att.Device, fsType, staging, err))
	}
	if !spec.Options.ReadOnly {
		grown, err := n.cfg.Mounter.Resize(att.Device, staging)
		if err != nil {
			// Not left mounted: a retry must find the staging path
			// empty, not a file system on a device that is gone.
			if uerr := n.cfg.Mounter.Unmount(staging); uerr != nil {
				err = errors.Join(err, fmt.Errorf("unmount %s: %w", staging, uerr))
			}
			return undo(fmt.Errorf("grow the filesystem on %s to the volume's size: %w", att.Device, err))
		}
		if grown {
			log.Info("filesystem grown to the volume's size at stage")
		}
	}
	log.Info("volume staged", "fs_type", fsType)
	return nil
}

func (n *Node) NodeUnstageVolume(ctx context.Context, req *csi.NodeUnstageVolumeRequest) (*csi.NodeUnstageVolumeResponse, error) {
	id, staging := req.GetVolumeId(), req.GetStagingTargetPath()
	if id == "" {
		return nil, invalid("volume_id is required")
	}
	if staging == "" {
		return nil, invalid("staging_target_path is required")
	}
	unlock, ok := n.lock(id)
	if !ok {
		return nil, aborted("unstage", id)
	}
	defer unlock()

	if err := n.unmountIfMounted(staging); err != nil {
		return nil, toStatus(fmt.Errorf("unstage volume %s: %w", id, err))
	}
	if err := os.Remove(filepath.Join(staging, deviceFile)); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return nil, toStatus(fmt.Errorf("unstage volume %s: %w", id, err))
	}
	if err := n.cfg.Attacher.Detach(ctx, id); err != nil {
		return nil, toStatus(fmt.Errorf("detach volume %s: %w", id, err))
	}
	n.forgetExpected(id)
	if n.cfg.Observer != nil {
		n.cfg.Observer.Unstaged(id)
	}
	n.log.Info("volume unstaged", "volume_id", id, "staging_target_path", staging)
	return &csi.NodeUnstageVolumeResponse{}, nil
}

// unmountIfMounted unmounts path when it is a mount point; a missing path
// is not an error.
func (n *Node) unmountIfMounted(path string) error {
	mounted, err := n.cfg.Mounter.IsMountPoint(path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("check %s: %w", path, err)
	}
	if !mounted {
		return nil
	}
	if err := n.cfg.Mounter.Unmount(path); err != nil {
		return fmt.Errorf("unmount %s: %w", path, err)
	}
	return nil
}

func (n *Node) NodePublishVolume(ctx context.Context, req *csi.NodePublishVolumeRequest) (*csi.NodePublishVolumeResponse, error) {
	id, target, staging := req.GetVolumeId(), req.GetTargetPath(), req.GetStagingTargetPath()
	if id == "" {
		return nil, invalid("volume_id is required")
	}
	if staging == "" {
		return nil, invalid("staging_target_path is required")
	}
	if target == "" {
		return nil, invalid("target_path is required")
	}
	capability := req.GetVolumeCapability()
	if err := checkCapability(capability); err != nil {
		return nil, err
	}
	// Publishes of one volume to different targets do not conflict.
	unlock, ok := n.lock(id + "\x00" + target)
	if !ok {
		return nil, aborted("publish", id)
	}
	defer unlock()

	opts := []string{"bind"}
	if req.GetReadonly() || readOnlyMode(capability) {
		opts = append(opts, "ro")
	}
	n.pubMu.Lock()
	defer n.pubMu.Unlock()
	if capability.GetAccessMode().GetMode() == csi.VolumeCapability_AccessMode_SINGLE_NODE_SINGLE_WRITER {
		if other := n.otherTarget(id, target); other != "" {
			return nil, toStatus(fmt.Errorf("%w: volume %s is single-writer and already published at %s", ErrPrecondition, id, other))
		}
	}
	var err error
	if capability.GetBlock() != nil {
		err = n.publishBlock(id, staging, target, opts)
	} else {
		err = n.publishMount(id, staging, target, append(opts, capability.GetMount().GetMountFlags()...))
	}
	if err != nil {
		return nil, toStatus(err)
	}
	if n.pubs[id] == nil {
		n.pubs[id] = map[string]bool{}
	}
	n.pubs[id][target] = true
	return &csi.NodePublishVolumeResponse{}, nil
}

// otherTarget returns a target path other than target where this process
// published volume id and that is still mounted; "" if none. The caller
// holds pubMu.
func (n *Node) otherTarget(id, target string) string {
	for t := range n.pubs[id] {
		if t == target {
			continue
		}
		if mounted, err := n.cfg.Mounter.IsMountPoint(t); err == nil && mounted {
			return t
		}
		delete(n.pubs[id], t)
	}
	return ""
}

func (n *Node) publishMount(id, staging, target string, opts []string) error {
	m := n.cfg.Mounter
	staged, err := m.IsMountPoint(staging)
	if errors.Is(err, fs.ErrNotExist) || (err == nil && !staged) {
		return fmt.Errorf("%w: volume %s is not staged at %s", ErrPrecondition, id, staging)
	}
	if err != nil {
		return fmt.Errorf("check staging path: %w", err)
	}
	if err := m.MakeDir(target); err != nil {
		return fmt.Errorf("create target path: %w", err)
	}
	if err := n.bindOnce(staging, target, opts); err != nil {
		return err
	}
	n.log.Info("volume published", "volume_id", id, "target_path", target)
	return nil
}

// bindOnce bind-mounts src at target unless target already is a mount
// point (publish is idempotent).
func (n *Node) bindOnce(src, target string, opts []string) error {
	mounted, err := n.cfg.Mounter.IsMountPoint(target)
	if err != nil {
		return fmt.Errorf("check target path: %w", err)
	}
	if mounted {
		return nil
	}
	if err := n.cfg.Mounter.Mount(src, target, "", opts); err != nil {
		return fmt.Errorf("bind mount %s at %s: %w", src, target, err)
	}
	return nil
}

func (n *Node) publishBlock(id, staging, target string, opts []string) error {
	m := n.cfg.Mounter
	dev, err := stagedDevice(staging)
	if err != nil {
		return fmt.Errorf("volume %s: %w", id, err)
	}
	if err := m.MakeDir(filepath.Dir(target)); err != nil {
		return fmt.Errorf("create target directory: %w", err)
	}
	if err := m.MakeFile(target); err != nil {
		return fmt.Errorf("create target file: %w", err)
	}
	if err := n.bindOnce(dev, target, opts); err != nil {
		return err
	}
	n.log.Info("block volume published", "volume_id", id, "target_path", target, "device", dev)
	return nil
}

// stagedDevice reads the device of a staged Block volume.
func stagedDevice(staging string) (string, error) {
	b, err := os.ReadFile(filepath.Join(staging, deviceFile))
	if errors.Is(err, fs.ErrNotExist) {
		return "", fmt.Errorf("%w: not staged at %s", ErrPrecondition, staging)
	}
	if err != nil {
		return "", err
	}
	dev := strings.TrimSpace(string(b))
	if !strings.HasPrefix(dev, "/dev/") {
		return "", fmt.Errorf("%w: bad device %q recorded at %s", ErrPrecondition, dev, staging)
	}
	return dev, nil
}

func (n *Node) NodeUnpublishVolume(ctx context.Context, req *csi.NodeUnpublishVolumeRequest) (*csi.NodeUnpublishVolumeResponse, error) {
	id, target := req.GetVolumeId(), req.GetTargetPath()
	if id == "" {
		return nil, invalid("volume_id is required")
	}
	if target == "" {
		return nil, invalid("target_path is required")
	}
	unlock, ok := n.lock(id + "\x00" + target)
	if !ok {
		return nil, aborted("unpublish", id)
	}
	defer unlock()

	if err := n.unmountIfMounted(target); err != nil {
		return nil, toStatus(fmt.Errorf("unpublish volume %s: %w", id, err))
	}
	if err := os.Remove(target); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return nil, toStatus(fmt.Errorf("unpublish volume %s: remove target: %w", id, err))
	}
	n.pubMu.Lock()
	delete(n.pubs[id], target)
	if len(n.pubs[id]) == 0 {
		delete(n.pubs, id)
	}
	n.pubMu.Unlock()
	n.log.Info("volume unpublished", "volume_id", id, "target_path", target)
	return &csi.NodeUnpublishVolumeResponse{}, nil
}

func (n *Node) NodeGetVolumeStats(ctx context.Context, req *csi.NodeGetVolumeStatsRequest) (*csi.NodeGetVolumeStatsResponse, error) {
	id, path := req.GetVolumeId(), req.GetVolumePath()
	if id == "" {
		return nil, invalid("volume_id is required")
	}
	if path == "" {
		return nil, invalid("volume_path is required")
	}
	m := n.cfg.Mounter
	exists, err := m.PathExists(path)
	if err != nil {
		return nil, toStatus(fmt.Errorf("check volume path: %w", err))
	}
	if !exists {
		return nil, toStatus(fmt.Errorf("%w: volume path %s", ErrNotFound, path))
	}
	block, err := m.IsBlockDevice(path)
	if err != nil {
		return nil, toStatus(fmt.Errorf("check volume path: %w", err))
	}
	resp := &csi.NodeGetVolumeStatsResponse{}
	if block {
		size, err := m.GetDeviceSize(path)
		if err != nil {
			return nil, toStatus(fmt.Errorf("device size of %s: %w", path, err))
		}
		resp.Usage = []*csi.VolumeUsage{{Unit: csi.VolumeUsage_BYTES, Total: int64(size)}}
		return resp, nil
	}
	// statfs of a path with nothing mounted would report the host's
	// file system.
	mounted, err := m.IsMountPoint(path)
	if err != nil {
		return nil, toStatus(fmt.Errorf("check volume path: %w", err))
	}
	if !mounted {
		return nil, toStatus(fmt.Errorf("%w: no volume mounted at %s", ErrNotFound, path))
	}
	st, err := m.Statfs(path)
	if err != nil {
		return nil, toStatus(fmt.Errorf("statfs %s: %w", path, err))
	}
	resp.Usage = []*csi.VolumeUsage{
		{Unit: csi.VolumeUsage_BYTES, Total: st.TotalBytes, Available: st.AvailableBytes, Used: st.UsedBytes},
		{Unit: csi.VolumeUsage_INODES, Total: st.TotalInodes, Available: st.FreeInodes, Used: st.UsedInodes},
	}
	return resp, nil
}

// Health reasons reported by NodeGetVolumeHealth.
const (
	HealthNotAttached     = "NotAttached"
	HealthDisconnected    = "Disconnected"
	HealthMissingSubflows = "MissingSubflows"
)

// health reports the data path of a volume: inaccessible when it is not
// attached here or not connected, degraded when it runs over MPTCP with
// fewer subflows than the storage node has addresses; no entry when it
// is healthy.
func (n *Node) health(id string) *csi.VolumeHealth {
	tr, h, err := n.cfg.Attacher.Health(id)
	return n.volumeHealth(id, tr, h, err)
}

// volumeHealth is health for what the attacher said of the volume.
func (n *Node) volumeHealth(id string, tr attach.Transport, h attach.Health, err error) *csi.VolumeHealth {
	vh := &csi.VolumeHealth{VolumeId: id}
	add := func(st csi.VolumeHealthErrorType, reason, msg string) *csi.VolumeHealth {
		vh.HealthStatuses = append(vh.HealthStatuses, &csi.VolumeHealth_VolumeHealthEntry{Status: st, Reason: reason, Message: msg})
		return vh
	}
	if err != nil {
		return add(csi.VolumeHealthErrorType_INACCESSIBLE, HealthNotAttached, fmt.Sprintf("data path unknown: %v", err))
	}
	if !h.Connected {
		msg := fmt.Sprintf("%s: disconnected from the storage node", tr)
		if h.Message != "" {
			msg += ": " + h.Message
		}
		return add(csi.VolumeHealthErrorType_INACCESSIBLE, HealthDisconnected, msg)
	}
	if want, ok := n.expectedSubflows(id); ok && h.MPTCP {
		for i, got := range h.Subflows {
			if got < want {
				add(csi.VolumeHealthErrorType_DEGRADED, HealthMissingSubflows, fmt.Sprintf(
					"%s: connection %d has %d MPTCP subflows, want %d (one per storage address)", tr, i, got, want))
				break
			}
		}
	}
	return vh
}

// expectedSubflows is how many MPTCP subflows each connection of a
// healthy volume has: the storage addresses it was staged with, from
// memory or, after a restart of this process, from StateDir.
func (n *Node) expectedSubflows(id string) (int, bool) {
	f, ok := n.staged(id)
	return f.addrs, ok
}

// staged is what rememberExpected kept of volume id, from memory or,
// after a restart of this process, from StateDir.
func (n *Node) staged(id string) (stagedFacts, bool) {
	if f, ok := n.addrs.Load(id); ok {
		return f.(stagedFacts), true
	}
	p := n.expectedFile(id)
	if p == "" {
		return stagedFacts{}, false
	}
	b, err := os.ReadFile(p)
	if err != nil {
		if !errors.Is(err, fs.ErrNotExist) {
			n.log.Warn("read the volume's storage address count", "volume_id", id, "error", err)
		}
		return stagedFacts{}, false
	}
	fields := strings.Fields(string(b))
	var f stagedFacts
	if len(fields) > 0 {
		f.addrs, err = strconv.Atoi(fields[0])
	}
	if len(fields) == 0 || len(fields) > 2 || err != nil || f.addrs < 1 {
		n.log.Warn("a malformed storage address count; subflows go unchecked", "volume_id", id, "path", p, "content", string(b))
		return stagedFacts{}, false
	}
	if len(fields) == 2 {
		f.storageNode = fields[1]
	}
	if b, err := os.ReadFile(n.infoFile(id)); err == nil {
		if err := json.Unmarshal(b, &f.volumeInfo); err != nil {
			n.log.Warn("a malformed volume info file; the metrics leave its claim and device out", "volume_id", id, "error", err)
			f.volumeInfo = volumeInfo{}
		}
	}
	n.addrs.Store(id, f)
	return f, true
}

// infoFile is where StateDir keeps the volume's volumeInfo (see
// expectedFile).
func (n *Node) infoFile(id string) string {
	if n.expectedFile(id) == "" {
		return ""
	}
	return filepath.Join(n.cfg.StateDir, infoDir, id)
}

// expectedFile is where StateDir keeps the volume's storage address
// count; empty without a StateDir or for an ID that is no file name.
func (n *Node) expectedFile(id string) string {
	if n.cfg.StateDir == "" || id == "" || id != filepath.Base(id) || strings.HasPrefix(id, ".") {
		return ""
	}
	return filepath.Join(n.cfg.StateDir, expectedDir, id)
}

// rememberExpected records what the node keeps of a staged volume, in
// memory and in StateDir. A failed write costs only the subflow check
// after a restart, so it is logged, not returned.
func (n *Node) rememberExpected(id string, f stagedFacts) {
	n.addrs.Store(id, f)
	p := n.expectedFile(id)
	if p == "" {
		return
	}
	line := strconv.Itoa(f.addrs)
	if f.storageNode != "" && !strings.ContainsAny(f.storageNode, " \t\n") {
		line += " " + f.storageNode
	}
	if err := attach.WriteFileAtomic(p, []byte(line+"\n")); err != nil {
		n.log.Warn("keep the volume's storage address count; after a restart its subflows go unchecked", "volume_id", id, "error", err)
	}
	b, err := json.Marshal(f.volumeInfo)
	if err == nil {
		err = attach.WriteFileAtomic(n.infoFile(id), append(b, '\n'))
	}
	if err != nil {
		n.log.Warn("keep the volume's claim and device; after a restart its metrics leave them out", "volume_id", id, "error", err)
	}
}

// forgetExpected drops what rememberExpected kept.
func (n *Node) forgetExpected(id string) {
	n.addrs.Delete(id)
	for _, p := range []string{n.expectedFile(id), n.infoFile(id)} {
		if p == "" {
			continue
		}
		if err := os.Remove(p); err != nil && !errors.Is(err, fs.ErrNotExist) {
			n.log.Warn("remove what the node kept of the volume", "volume_id", id, "path", p, "error", err)
		}
	}
}

func (n *Node) NodeGetVolumeHealth(ctx context.Context, req *csi.NodeGetVolumeHealthRequest) (*csi.NodeGetVolumeHealthResponse, error) {
	id := req.GetVolumeId()
	if id == "" {
		return nil, invalid("volume_id is required")
	}
	for _, p := range []string{req.GetVolumePublishPath(), req.GetStagingTargetPath()} {
		if p == "" {
			continue
		}
		exists, err := n.cfg.Mounter.PathExists(p)
		if err != nil {
			return nil, toStatus(fmt.Errorf("check %s: %w", p, err))
		}
		if !exists {
			return nil, toStatus(fmt.Errorf("%w: path %s", ErrNotFound, p))
		}
	}
	return &csi.NodeGetVolumeHealthResponse{VolumeHealth: n.health(id)}, nil
}

func (n *Node) NodeExpandVolume(ctx context.Context, req *csi.NodeExpandVolumeRequest) (*csi.NodeExpandVolumeResponse, error) {
	id, path := req.GetVolumeId(), req.GetVolumePath()
	if id == "" {
		return nil, invalid("volume_id is required")
	}
	if path == "" {
		return nil, invalid("volume_path is required")
	}
	if c := req.GetVolumeCapability(); c != nil {
		if err := checkCapability(c); err != nil {
			return nil, err
		}
	}
	m := n.cfg.Mounter
	exists, err := m.PathExists(path)
	if err != nil {
		return nil, toStatus(fmt.Errorf("check volume path: %w", err))
	}
	if !exists {
		return nil, toStatus(fmt.Errorf("%w: volume path %s", ErrNotFound, path))
	}
	unlock, ok := n.lock(id)
	if !ok {
		return nil, aborted("expand", id)
	}
	defer unlock()

	// The storage node has grown the export (ControllerExpandVolume waits
	// for that); the device learns the new size from a fresh handshake.
	want := req.GetCapacityRange().GetRequiredBytes()
	if _, err := n.cfg.Attacher.Resize(ctx, id, uint64(max(want, 0))); err != nil {
		if !errors.Is(err, attach.ErrNotAttached) {
			return nil, toStatus(fmt.Errorf("resize the device of %s: %w", id, err))
		}
		n.log.Warn("expand: volume not attached by this process; checking the device as it is", "volume_id", id)
	}
	block, err := m.IsBlockDevice(path)
	if err != nil {
		return nil, toStatus(fmt.Errorf("check volume path: %w", err))
	}
	block = block || req.GetVolumeCapability().GetBlock() != nil
	dev, mountPath := path, path
	if !block {
		if s := req.GetStagingTargetPath(); s != "" {
			mountPath = s
		}
		if dev, err = m.DeviceFromMount(mountPath); err != nil {
			return nil, toStatus(fmt.Errorf("device of %s: %w", mountPath, err))
		}
	}
	size, err := m.GetDeviceSize(dev)
	if err != nil {
		return nil, toStatus(fmt.Errorf("device size of %s: %w", dev, err))
	}
	if want > 0 && uint64(want) > size {
		// Until the device has grown, the kubelet retries.
		return nil, toStatus(fmt.Errorf("%w: device %s has %d bytes, %d requested", ErrUnavailable, dev, size, want))
	}
	if !block {
		if _, err := m.Resize(dev, mountPath); err != nil {
			return nil, toStatus(fmt.Errorf("resize file system on %s: %w", dev, err))
		}
		n.log.Info("file system resized", "volume_id", id, "device", dev, "bytes", size)
	}
	return &csi.NodeExpandVolumeResponse{CapacityBytes: int64(size)}, nil
}

func (n *Node) NodeGetCapabilities(context.Context, *csi.NodeGetCapabilitiesRequest) (*csi.NodeGetCapabilitiesResponse, error) {
	var caps []*csi.NodeServiceCapability
	for _, t := range []csi.NodeServiceCapability_RPC_Type{
		csi.NodeServiceCapability_RPC_STAGE_UNSTAGE_VOLUME,
		csi.NodeServiceCapability_RPC_GET_VOLUME_STATS,
		csi.NodeServiceCapability_RPC_EXPAND_VOLUME,
		csi.NodeServiceCapability_RPC_GET_VOLUME_HEALTH,
		csi.NodeServiceCapability_RPC_SINGLE_NODE_MULTI_WRITER,
	} {
		caps = append(caps, &csi.NodeServiceCapability{Type: &csi.NodeServiceCapability_Rpc{
			Rpc: &csi.NodeServiceCapability_RPC{Type: t},
		}})
	}
	return &csi.NodeGetCapabilitiesResponse{Capabilities: caps}, nil
}

func (n *Node) NodeGetInfo(context.Context, *csi.NodeGetInfoRequest) (*csi.NodeGetInfoResponse, error) {
	resp := &csi.NodeGetInfoResponse{NodeId: n.cfg.NodeID, MaxVolumesPerNode: n.cfg.MaxVolumes}
	if len(n.cfg.Topology) > 0 {
		resp.AccessibleTopology = &csi.Topology{Segments: maps.Clone(n.cfg.Topology)}
	}
	return resp, nil
}
