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
	"cmp"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"math"
	"slices"
	"strings"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"k8s.io/apimachinery/pkg/util/validation"

	"github.com/mpnbd/mpnbd/api/v1alpha1"
)

// defaultSizeUnit is what volume sizes are rounded up to unless the
// blockSize parameter says otherwise.
const defaultSizeUnit = 4096

// maxVolumeIDLength keeps volume IDs valid label values (publication
// Secrets are labelled with them).
const maxVolumeIDLength = validation.LabelValueMaxLength

// VolumeIDForName returns the volume ID (the NBDVolume's name) of a CSI
// volume name: the name itself when it is a DNS-1123 subdomain of at most
// 63 characters, else "vol-" and 32 hex digits of its SHA-256.
func VolumeIDForName(name string) string {
	if len(name) <= maxVolumeIDLength && len(validation.IsDNS1123Subdomain(name)) == 0 {
		return name
	}
	sum := sha256.Sum256([]byte(name))
	return "vol-" + hex.EncodeToString(sum[:16])
}

// validVolumeID reports whether id could name an NBDVolume; no volume has
// any other ID, so the RPCs answer "not found" without asking.
func validVolumeID(id string) bool {
	return len(id) <= maxVolumeIDLength && len(validation.IsDNS1123Subdomain(id)) == 0
}

func isLabelValue(s string) bool {
	return len(validation.IsValidLabelValue(s)) == 0
}

// capabilitiesAccess checks CreateVolume's capabilities and returns the
// access type they ask for and whether any needs more than one node.
func capabilitiesAccess(caps []*csi.VolumeCapability) (v1alpha1.AccessType, bool, error) {
	if len(caps) == 0 {
		return "", false, invalid("volume_capabilities are required")
	}
	var block, mount, multi bool
	for _, vc := range caps {
		if err := checkCapability(vc); err != nil {
			return "", false, err
		}
		if vc.GetBlock() != nil {
			block = true
		} else {
			mount = true
		}
		multi = multi || multiNodeMode(vc.GetAccessMode().GetMode())
	}
	if block && mount {
		return "", false, invalid("volume_capabilities mix block and mount access types")
	}
	if block {
		return v1alpha1.AccessBlock, multi, nil
	}
	return v1alpha1.AccessFilesystem, multi, nil
}

func multiNodeMode(m csi.VolumeCapability_AccessMode_Mode) bool {
	switch m {
	case csi.VolumeCapability_AccessMode_MULTI_NODE_READER_ONLY,
		csi.VolumeCapability_AccessMode_MULTI_NODE_SINGLE_WRITER,
		csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER:
		return true
	}
	return false
}

// capabilityMismatch says why a (valid) capability does not fit volume v,
// or returns "" when it fits.
func capabilityMismatch(v *v1alpha1.NBDVolume, vc *csi.VolumeCapability) string {
	switch {
	case vc.GetBlock() != nil && v.Spec.AccessType != v1alpha1.AccessBlock:
		return fmt.Sprintf("volume %s is a %s volume; block access was asked for", v.Name, v.Spec.AccessType)
	case vc.GetMount() != nil && v.Spec.AccessType != v1alpha1.AccessFilesystem:
		return fmt.Sprintf("volume %s is a %s volume; mount access was asked for", v.Name, v.Spec.AccessType)
	case multiNodeMode(vc.GetAccessMode().GetMode()) && !v.Spec.MultiNode:
		return fmt.Sprintf("volume %s was created for one node; access mode %s needs a multi-node volume",
			v.Name, vc.GetAccessMode().GetMode())
	}
	return ""
}

func sizeUnit(p Params) int64 {
	if p.BlockSize > 0 {
		return int64(p.BlockSize)
	}
	return defaultSizeUnit
}

// checkRange rejects negative bounds and a required size above the limit.
func checkRange(r *csi.CapacityRange) error {
	req, lim := r.GetRequiredBytes(), r.GetLimitBytes()
	if req < 0 || lim < 0 {
		return invalid("capacity_range must not be negative (required %d, limit %d)", req, lim)
	}
	if lim > 0 && req > lim {
		return invalid("capacity_range: required_bytes %d exceeds limit_bytes %d", req, lim)
	}
	return nil
}

// roundUp rounds n up to a multiple of unit; ok is false on overflow.
func roundUp(n, unit int64) (int64, bool) {
	if n > math.MaxInt64-unit {
		return 0, false
	}
	return (n + unit - 1) / unit * unit, true
}

// volumeSize is the size of a new volume: the required bytes (the default
// when the range sets neither bound, at most the limit) rounded up to
// unit. A range that holds no multiple of unit is OutOfRange.
func volumeSize(r *csi.CapacityRange, def, unit int64) (int64, error) {
	if err := checkRange(r); err != nil {
		return 0, err
	}
	req, lim := r.GetRequiredBytes(), r.GetLimitBytes()
	size := req
	if size == 0 {
		size = def
		if lim > 0 {
			size = min(size, lim)
		}
	}
	size, ok := roundUp(max(size, 1), unit)
	if ok && (lim == 0 || size <= lim) {
		return size, nil
	}
	if req == 0 && lim >= unit {
		return lim / unit * unit, nil
	}
	return 0, fmt.Errorf("%w: no size in multiples of %d bytes fits the capacity range (required %d, limit %d)",
		ErrOutOfRange, unit, req, lim)
}

// fsMinSize is the smallest device each file system's mkfs formats; a
// file system missing here takes any size. mkfs.xfs refuses a data
// section under 300 MiB ("Filesystem must be larger than 300MB", xfsprogs
// 5.19 and later: 6.1 in Debian 12); exactly 300 MiB formats.
var fsMinSize = map[string]int64{"xfs": 300 << 20}

// volumeFSType is the file system NodeStageVolume formats a Filesystem
// volume with: the capability's fs_type (which the provisioner fills in
// from csi.storage.k8s.io/fstype or its --default-fstype) wins over the
// fsType parameter.
func volumeFSType(caps []*csi.VolumeCapability, p Params) string {
	for _, vc := range caps {
		if t := vc.GetMount().GetFsType(); t != "" {
			return t
		}
	}
	return p.FSType
}

// fitFSMinimum raises the size of a new Filesystem volume to the smallest
// its file system can be made on (rounded up to unit), so that a small
// claim does not fail at NodeStageVolume with mkfs's usage text. A
// limit_bytes below that minimum is OutOfRange and names it.
func fitFSMinimum(size int64, r *csi.CapacityRange, unit int64, fsType string) (int64, error) {
	least, ok := fsMinSize[fsType]
	if !ok || size >= least {
		return size, nil
	}
	least, _ = roundUp(least, unit) // unit is at most 4096: no overflow
	if lim := r.GetLimitBytes(); lim > 0 && least > lim {
		return 0, fmt.Errorf("%w: %s volumes need at least %d bytes (%d MiB; mkfs.%s refuses smaller devices), above limit_bytes %d",
			ErrOutOfRange, fsType, least, least>>20, fsType, lim)
	}
	return least, nil
}

// expandSize is the size ControllerExpandVolume grows a volume to (0 when
// the range asks for no particular size).
func expandSize(r *csi.CapacityRange, unit int64) (int64, error) {
	if err := checkRange(r); err != nil {
		return 0, err
	}
	req, lim := r.GetRequiredBytes(), r.GetLimitBytes()
	size, ok := roundUp(req, unit)
	if !ok || (lim > 0 && size > lim) {
		return 0, fmt.Errorf("%w: %d bytes rounded up to a multiple of %d exceed limit_bytes %d",
			ErrOutOfRange, req, unit, lim)
	}
	return size, nil
}

// storedParams are the StorageClass parameters a volume keeps: all but
// those the Kubernetes sidecars add.
func storedParams(in map[string]string) map[string]string {
	var out map[string]string
	for k, v := range in {
		if strings.HasPrefix(k, reservedPrefix) {
			continue
		}
		if out == nil {
			out = map[string]string{}
		}
		out[k] = v
	}
	return out
}

func formatParams(p map[string]string) string {
	if len(p) == 0 {
		return "none"
	}
	var parts []string
	for k, v := range p {
		parts = append(parts, k+"="+v)
	}
	slices.Sort(parts)
	return strings.Join(parts, ",")
}

func (c *Controller) storageNodes(ctx context.Context) ([]v1alpha1.NBDStorageNode, error) {
	var list v1alpha1.NBDStorageNodeList
	if err := c.c.List(ctx, &list); err != nil {
		return nil, kubeErr(err, "listing NBDStorageNodes")
	}
	return list.Items, nil
}

// topologies maps storage node names to their topology.
func (c *Controller) topologies(ctx context.Context) (map[string]map[string]string, error) {
	nodes, err := c.storageNodes(ctx)
	if err != nil {
		return nil, err
	}
	out := make(map[string]map[string]string, len(nodes))
	for _, n := range nodes {
		out[n.Name] = n.Status.Topology
	}
	return out, nil
}

// fresh reports whether a storage node's agent reported recently.
func (c *Controller) fresh(n *v1alpha1.NBDStorageNode) bool {
	hb := n.Status.Heartbeat.Time
	return !hb.IsZero() && time.Since(hb) <= c.cfg.StaleAfter
}

// paramsMatch reports whether a storage node is the one the storageNode
// parameter names and carries every storageNodeSelector pair, as a label
// or in its topology.
func paramsMatch(n *v1alpha1.NBDStorageNode, p Params) bool {
	if p.StorageNode != "" && n.Name != p.StorageNode {
		return false
	}
	for k, v := range p.NodeSelector {
		if l, ok := n.Labels[k]; ok && l == v {
			continue
		}
		if t, ok := n.Status.Topology[k]; ok && t == v {
			continue
		}
		return false
	}
	return true
}

// topologyMatches reports whether every key of segment has the same value
// in a node's topology.
func topologyMatches(topo, segment map[string]string) bool {
	for k, v := range segment {
		if t, ok := topo[k]; !ok || t != v {
			return false
		}
	}
	return true
}

// pickStorageNode chooses where a new volume of size bytes goes: among
// the fresh storage nodes that match the parameters and one of the
// requisite topologies (when there are any) and have room, the first
// preferred topology that has a candidate, and in it (or among all) the
// node with the most available bytes.
//
// Why nothing fits decides the code: a storageNode parameter naming no
// storage node is InvalidArgument; no storage node at all, or none with a
// recent heartbeat, is Unavailable (agents may come up); no node matching
// the selector or topology, or none with room, is ResourceExhausted.
func (c *Controller) pickStorageNode(ctx context.Context, p Params, tr *csi.TopologyRequirement, size int64) (*v1alpha1.NBDStorageNode, error) {
	nodes, err := c.storageNodes(ctx)
	if err != nil {
		return nil, err
	}
	var named, matching, fresh, open int
	var largest int64
	var roomy []*v1alpha1.NBDStorageNode
	for i := range nodes {
		n := &nodes[i]
		if p.StorageNode != "" && n.Name != p.StorageNode {
			continue
		}
		named++
		if !paramsMatch(n, p) {
			continue
		}
		if req := tr.GetRequisite(); len(req) > 0 && !slices.ContainsFunc(req, func(t *csi.Topology) bool {
			return topologyMatches(n.Status.Topology, t.GetSegments())
		}) {
			continue
		}
		matching++
		if !c.fresh(n) {
			continue
		}
		fresh++
		if !n.Schedulable() {
			continue
		}
		open++
		largest = max(largest, n.Status.AvailableBytes)
		if n.Status.AvailableBytes >= size {
			roomy = append(roomy, n)
		}
	}
	switch {
	case p.StorageNode != "" && named == 0:
		return nil, fmt.Errorf("%w: StorageClass parameter %s=%q: no such storage node (no NBDStorageNode of that name)",
			ErrInvalidArgument, ParamStorageNode, p.StorageNode)
	case len(nodes) == 0:
		return nil, fmt.Errorf("%w: no storage node has reported yet (no NBDStorageNode objects)", ErrUnavailable)
	case matching == 0:
		return nil, fmt.Errorf("%w: no storage node matches the StorageClass parameters and accessibility requirements",
			ErrExhausted)
	case fresh == 0:
		return nil, fmt.Errorf("%w: no matching storage node reported within %s", ErrUnavailable, c.cfg.StaleAfter)
	case open == 0:
		return nil, fmt.Errorf("%w: every matching storage node is cordoned or draining (spec.unschedulable, spec.drain)", ErrExhausted)
	case len(roomy) == 0:
		return nil, fmt.Errorf("%w: no matching storage node has %d bytes available (the most is %d)",
			ErrExhausted, size, largest)
	}
	slices.SortFunc(roomy, func(a, b *v1alpha1.NBDStorageNode) int {
		return cmp.Or(cmp.Compare(b.Status.AvailableBytes, a.Status.AvailableBytes), strings.Compare(a.Name, b.Name))
	})
	for _, t := range tr.GetPreferred() {
		for _, n := range roomy {
			if topologyMatches(n.Status.Topology, t.GetSegments()) {
				return n, nil
			}
		}
	}
	return roomy[0], nil
}

// ZoneLabel is the topology key whose values replicas of one volume keep
// apart, when the storage nodes carry it.
const ZoneLabel = "topology.kubernetes.io/zone"

// pickStorageNodes chooses the storage nodes of a new volume's p.Replicas
// replicas: the first as pickStorageNode does (the volume's primary at
// first), the others among the other fresh storage nodes that match the
// parameters (storageNode pins the first only), every requisite topology
// (any replica may become primary) and have room, by placeReplicas.
func (c *Controller) pickStorageNodes(ctx context.Context, p Params, tr *csi.TopologyRequirement, size int64) ([]*v1alpha1.NBDStorageNode, error) {
	first, err := c.pickStorageNode(ctx, p, tr, size)
	if err != nil {
		return nil, err
	}
	if p.Replicas <= 1 {
		return []*v1alpha1.NBDStorageNode{first}, nil
	}
	nodes, err := c.storageNodes(ctx)
	if err != nil {
		return nil, err
	}
	rest := p
	rest.StorageNode = ""
	var cands []*v1alpha1.NBDStorageNode
	for i := range nodes {
		n := &nodes[i]
		if n.Name == first.Name || !paramsMatch(n, rest) || !c.fresh(n) || !n.Schedulable() || n.Status.AvailableBytes < size {
			continue
		}
		if req := tr.GetRequisite(); len(req) > 0 && !slices.ContainsFunc(req, func(t *csi.Topology) bool {
			return topologyMatches(n.Status.Topology, t.GetSegments())
		}) {
			continue
		}
		cands = append(cands, n)
	}
	return placeReplicas(first, cands, p.Replicas, size)
}

// nodeZone is the zone of a storage node (ZoneLabel in its topology, or
// its label), "" when it has none.
func nodeZone(x *v1alpha1.NBDStorageNode) string {
	if z, ok := x.Status.Topology[ZoneLabel]; ok {
		return z
	}
	return x.Labels[ZoneLabel]
}

// placeReplicas completes first with n-1 of cands, each on its own node
// and, among nodes that carry ZoneLabel, each in its own zone; the nodes
// with the most available bytes first. Too few is ResourceExhausted.
func placeReplicas(first *v1alpha1.NBDStorageNode, cands []*v1alpha1.NBDStorageNode, n int, size int64) ([]*v1alpha1.NBDStorageNode, error) {
	zone := nodeZone
	out := []*v1alpha1.NBDStorageNode{first}
	used := map[string]bool{}
	if z := zone(first); z != "" {
		used[z] = true
	}
	cands = slices.Clone(cands)
	slices.SortFunc(cands, func(a, b *v1alpha1.NBDStorageNode) int {
		return cmp.Or(cmp.Compare(b.Status.AvailableBytes, a.Status.AvailableBytes), strings.Compare(a.Name, b.Name))
	})
	for _, c := range cands {
		if len(out) == n {
			break
		}
		if c.Name == first.Name || v1alpha1.ValidReplicaNode(c.Name) != nil {
			// A node whose name makes no label name cannot be watched
			// for its replicas (v1alpha1.ReplicaLabel).
			continue
		}
		z := zone(c)
		if z != "" && used[z] {
			continue
		}
		if z != "" {
			used[z] = true
		}
		out = append(out, c)
	}
	if len(out) < n {
		return nil, fmt.Errorf("%w: %d replicas need %d storage nodes besides %s that are fresh, match the StorageClass parameters and accessibility requirements, have %d bytes available and sit in zones (%s) of their own; %d do",
			ErrExhausted, n, n-1, first.Name, size, ZoneLabel, len(out)-1)
	}
	return out, nil
}
