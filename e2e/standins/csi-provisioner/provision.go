package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"strings"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"sigs.k8s.io/sig-storage-lib-external-provisioner/v13/controller"

	"github.com/mpnbd/mpnbd/e2e/standins/internal/sidecar"
)

// The StorageClass parameters and annotations the external-provisioner
// reads; the csi.storage.k8s.io/ ones are never passed to the driver.
const (
	paramPrefix       = "csi.storage.k8s.io/"
	paramFSType       = paramPrefix + "fstype"
	paramLegacyFSType = "fstype" // any case
	paramPVCName      = paramPrefix + "pvc/name"
	paramPVCNamespace = paramPrefix + "pvc/namespace"
	paramPVName       = paramPrefix + "pv/name"
	// attrIdentity marks the volumes this provisioner instance created.
	attrIdentity = "storage.kubernetes.io/csiProvisionerIdentity"
)

var errNoTopology = errors.New("no topology")

// capabilities are the claim's access modes, each a capability of the
// claim's volume mode: a raw block device, or a filesystem of fsType
// mounted with mountOptions.
func capabilities(modes []corev1.PersistentVolumeAccessMode, block bool, fsType string, mountOptions []string, singleNodeMultiWriter bool) ([]*csi.VolumeCapability, error) {
	if len(modes) == 0 {
		return nil, errors.New("the claim has no access modes")
	}
	var out []*csi.VolumeCapability
	for _, m := range modes {
		mode, err := sidecar.AccessMode(m, singleNodeMultiWriter)
		if err != nil {
			return nil, err
		}
		c := &csi.VolumeCapability{AccessMode: &csi.VolumeCapability_AccessMode{Mode: mode}}
		if block {
			c.AccessType = &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}}
		} else {
			c.AccessType = &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{
				FsType: fsType, MountFlags: slices.Clone(mountOptions),
			}}
		}
		out = append(out, c)
	}
	return out, nil
}

// isBlock reports whether the claim asks for a raw block volume.
func isBlock(pvc *corev1.PersistentVolumeClaim) bool {
	return pvc.Spec.VolumeMode != nil && *pvc.Spec.VolumeMode == corev1.PersistentVolumeBlock
}

// fsTypeOf is the class's csi.storage.k8s.io/fstype, else its legacy
// fsType parameter, else def; both set is an error.
func fsTypeOf(params map[string]string, def string) (string, error) {
	var fs, legacy string
	for k, v := range params {
		switch {
		case strings.ToLower(k) == paramFSType:
			fs = v
		case strings.ToLower(k) == paramLegacyFSType:
			legacy = v
		}
	}
	switch {
	case fs != "" && legacy != "":
		return "", fmt.Errorf("StorageClass sets both %s and fsType", paramFSType)
	case fs != "":
		return fs, nil
	case legacy != "":
		return legacy, nil
	}
	return def, nil
}

// createParams are the class parameters the driver gets: without the
// csi.storage.k8s.io/ ones, plus the claim's and PV's names with
// extraMetadata.
func createParams(class map[string]string, pvc *corev1.PersistentVolumeClaim, pvName string, extraMetadata bool) map[string]string {
	out := map[string]string{}
	for k, v := range class {
		if !strings.HasPrefix(strings.ToLower(k), paramPrefix) {
			out[k] = v
		}
	}
	if extraMetadata {
		out[paramPVCName] = pvc.Name
		out[paramPVCNamespace] = pvc.Namespace
		out[paramPVName] = pvName
	}
	return out
}

// nodeSegment is the topology segment of a node for driver: the values of
// the node's labels for the keys its CSINode lists for the driver.
// errNoTopology when the driver is not registered there or lists no keys.
func nodeSegment(node *corev1.Node, csiNode *storagev1.CSINode, driver string) (map[string]string, error) {
	for _, d := range csiNode.Spec.Drivers {
		if d.Name != driver {
			continue
		}
		if len(d.TopologyKeys) == 0 {
			return nil, errNoTopology
		}
		seg := map[string]string{}
		for _, k := range d.TopologyKeys {
			v, ok := node.Labels[k]
			if !ok {
				return nil, fmt.Errorf("node %s has no label %s (a topology key of %s)", node.Name, k, driver)
			}
			seg[k] = v
		}
		return seg, nil
	}
	return nil, fmt.Errorf("%w: driver %s is not registered on node %s", errNoTopology, driver, csiNode.Name)
}

// requirement is the accessibility requirement of a volume whose node
// was selected: that node's segment, requisite and preferred.
func requirement(seg map[string]string) *csi.TopologyRequirement {
	t := &csi.Topology{Segments: maps.Clone(seg)}
	return &csi.TopologyRequirement{Requisite: []*csi.Topology{t}, Preferred: []*csi.Topology{t}}
}

// segmentsRequirement is the requirement of a volume without a selected
// node: any of the segments (sorted, deduplicated); nil without any.
func segmentsRequirement(segs []map[string]string) *csi.TopologyRequirement {
	segs = uniqueSegments(segs)
	if len(segs) == 0 {
		return nil
	}
	var ts []*csi.Topology
	for _, s := range segs {
		ts = append(ts, &csi.Topology{Segments: s})
	}
	return &csi.TopologyRequirement{Requisite: ts, Preferred: ts}
}

// uniqueSegments sorts segments by their canonical string and drops
// duplicates.
func uniqueSegments(segs []map[string]string) []map[string]string {
	byKey := map[string]map[string]string{}
	for _, s := range segs {
		if len(s) > 0 {
			byKey[segmentString(s)] = s
		}
	}
	var out []map[string]string
	for _, k := range slices.Sorted(maps.Keys(byKey)) {
		out = append(out, byKey[k])
	}
	return out
}

func segmentString(s map[string]string) string {
	var b strings.Builder
	for _, k := range slices.Sorted(maps.Keys(s)) {
		fmt.Fprintf(&b, "%s=%s,", k, s[k])
	}
	return b.String()
}

// allowedSegments expands a class's allowedTopologies (each term a list of
// key In values) into segments.
func allowedSegments(terms []corev1.TopologySelectorTerm) []map[string]string {
	var out []map[string]string
	for _, term := range terms {
		segs := []map[string]string{{}}
		for _, e := range term.MatchLabelExpressions {
			var next []map[string]string
			for _, s := range segs {
				for _, v := range e.Values {
					n := maps.Clone(s)
					n[e.Key] = v
					next = append(next, n)
				}
			}
			segs = next
		}
		out = append(out, segs...)
	}
	return out
}

// nodeAffinity pins a PV to the segments the volume is accessible from;
// nil when it is accessible everywhere.
func nodeAffinity(topo []*csi.Topology) *corev1.VolumeNodeAffinity {
	var terms []corev1.NodeSelectorTerm
	for _, t := range topo {
		if len(t.GetSegments()) == 0 {
			continue
		}
		var exprs []corev1.NodeSelectorRequirement
		for _, k := range slices.Sorted(maps.Keys(t.GetSegments())) {
			exprs = append(exprs, corev1.NodeSelectorRequirement{
				Key: k, Operator: corev1.NodeSelectorOpIn, Values: []string{t.GetSegments()[k]},
			})
		}
		terms = append(terms, corev1.NodeSelectorTerm{MatchExpressions: exprs})
	}
	if len(terms) == 0 {
		return nil
	}
	return &corev1.VolumeNodeAffinity{Required: &corev1.NodeSelector{NodeSelectorTerms: terms}}
}

// pvSpec is what buildPV needs beyond the CreateVolume response.
type pvSpec struct {
	name     string
	driver   string
	identity string
	class    *storagev1.StorageClass
	pvc      *corev1.PersistentVolumeClaim
	fsType   string
	// requested is the claim's size, the capacity when the driver does
	// not report one.
	requested int64
}

// buildPV makes the PersistentVolume of a created volume.
func buildPV(s pvSpec, vol *csi.Volume) *corev1.PersistentVolume {
	reclaim := corev1.PersistentVolumeReclaimDelete
	if s.class.ReclaimPolicy != nil {
		reclaim = *s.class.ReclaimPolicy
	}
	size := vol.GetCapacityBytes()
	if size == 0 {
		size = s.requested
	}
	attrs := maps.Clone(vol.GetVolumeContext())
	if attrs == nil {
		attrs = map[string]string{}
	}
	attrs[attrIdentity] = s.identity
	src := &corev1.CSIPersistentVolumeSource{
		Driver:           s.driver,
		VolumeHandle:     vol.GetVolumeId(),
		VolumeAttributes: attrs,
	}
	if !isBlock(s.pvc) {
		src.FSType = s.fsType
	}
	mode := corev1.PersistentVolumeFilesystem
	if isBlock(s.pvc) {
		mode = corev1.PersistentVolumeBlock
	}
	return &corev1.PersistentVolume{
		ObjectMeta: metav1.ObjectMeta{Name: s.name},
		Spec: corev1.PersistentVolumeSpec{
			AccessModes:                   slices.Clone(s.pvc.Spec.AccessModes),
			Capacity:                      corev1.ResourceList{corev1.ResourceStorage: *resource.NewQuantity(size, resource.BinarySI)},
			PersistentVolumeReclaimPolicy: reclaim,
			MountOptions:                  slices.Clone(s.class.MountOptions),
			VolumeMode:                    &mode,
			StorageClassName:              s.class.Name,
			NodeAffinity:                  nodeAffinity(vol.GetAccessibleTopology()),
			PersistentVolumeSource:        corev1.PersistentVolumeSource{CSI: src},
		},
	}
}

// provisioner creates and deletes volumes through the CSI controller
// service for the provisioner library.
type provisioner struct {
	log      *slog.Logger
	kube     kubernetes.Interface
	csi      csi.ControllerClient
	driver   string
	identity string
	opts     options
	// singleNodeMultiWriter: the driver has the SINGLE_NODE_MULTI_WRITER
	// controller capability.
	singleNodeMultiWriter bool
}

var _ controller.BlockProvisioner = (*provisioner)(nil)

func (p *provisioner) SupportsBlock(context.Context) bool { return true }

// topologyFor is the accessibility requirement of the claim.
func (p *provisioner) topologyFor(ctx context.Context, o controller.ProvisionOptions) (*csi.TopologyRequirement, error) {
	if o.SelectedNodeName != "" {
		node, err := p.kube.CoreV1().Nodes().Get(ctx, o.SelectedNodeName, metav1.GetOptions{})
		if err != nil {
			return nil, err
		}
		cn, err := p.kube.StorageV1().CSINodes().Get(ctx, o.SelectedNodeName, metav1.GetOptions{})
		if err != nil {
			return nil, fmt.Errorf("CSINode of the selected node: %w", err)
		}
		seg, err := nodeSegment(node, cn, p.driver)
		if errors.Is(err, errNoTopology) && len(cn.Spec.Drivers) > 0 && slices.ContainsFunc(cn.Spec.Drivers, func(d storagev1.CSINodeDriver) bool { return d.Name == p.driver }) {
			return nil, nil // registered without topology keys
		}
		if err != nil {
			return nil, err
		}
		return requirement(seg), nil
	}
	if len(o.StorageClass.AllowedTopologies) > 0 {
		return segmentsRequirement(allowedSegments(o.StorageClass.AllowedTopologies)), nil
	}
	segs, err := driverSegments(ctx, p.kube, p.driver)
	if err != nil {
		return nil, err
	}
	return segmentsRequirement(segs), nil
}

// driverSegments lists the topology segments of the nodes where driver
// is registered with topology keys.
func driverSegments(ctx context.Context, kube kubernetes.Interface, driver string) ([]map[string]string, error) {
	cns, err := kube.StorageV1().CSINodes().List(ctx, metav1.ListOptions{})
	if err != nil {
		return nil, err
	}
	var segs []map[string]string
	for i := range cns.Items {
		cn := &cns.Items[i]
		node, err := kube.CoreV1().Nodes().Get(ctx, cn.Name, metav1.GetOptions{})
		if err != nil {
			continue // a CSINode outlives its Node briefly
		}
		seg, err := nodeSegment(node, cn, driver)
		if err != nil {
			continue
		}
		segs = append(segs, seg)
	}
	return uniqueSegments(segs), nil
}

func (p *provisioner) Provision(ctx context.Context, o controller.ProvisionOptions) (*corev1.PersistentVolume, controller.ProvisioningState, error) {
	class, pvc := o.StorageClass, o.PVC
	if o.PVC.Spec.DataSource != nil || o.PVC.Spec.DataSourceRef != nil {
		return nil, controller.ProvisioningFinished, errors.New("data sources (snapshots, clones) are not supported")
	}
	fsType, err := fsTypeOf(class.Parameters, p.opts.defaultFSType)
	if err != nil {
		return nil, controller.ProvisioningFinished, err
	}
	caps, err := capabilities(pvc.Spec.AccessModes, isBlock(pvc), fsType, class.MountOptions, p.singleNodeMultiWriter)
	if err != nil {
		return nil, controller.ProvisioningFinished, err
	}
	req := &csi.CreateVolumeRequest{
		Name:               o.PVName,
		Parameters:         createParams(class.Parameters, pvc, o.PVName, p.opts.extraCreateMetadata),
		VolumeCapabilities: caps,
		CapacityRange:      &csi.CapacityRange{},
	}
	requested := pvc.Spec.Resources.Requests[corev1.ResourceStorage]
	req.CapacityRange.RequiredBytes = requested.Value()
	if lim, ok := pvc.Spec.Resources.Limits[corev1.ResourceStorage]; ok {
		req.CapacityRange.LimitBytes = lim.Value()
	}
	if p.opts.topology {
		req.AccessibilityRequirements, err = p.topologyFor(ctx, o)
		if err != nil {
			return nil, controller.ProvisioningNoChange, fmt.Errorf("topology: %w", err)
		}
	}

	cctx, cancel := context.WithTimeout(ctx, p.opts.timeout)
	defer cancel()
	start := time.Now()
	resp, err := p.csi.CreateVolume(cctx, req)
	log := p.log.With("pvc", pvc.Namespace+"/"+pvc.Name, "pv", o.PVName)
	if err != nil {
		state := createState(err, o.SelectedNodeName != "")
		log.Warn("CreateVolume failed", "error", err, "state", state)
		return nil, state, fmt.Errorf("CreateVolume: %w", err)
	}
	log.Info("volume created", "volume_id", resp.GetVolume().GetVolumeId(),
		"capacity_bytes", resp.GetVolume().GetCapacityBytes(), "duration", time.Since(start))
	if resp.GetVolume().GetCapacityBytes() != 0 && resp.GetVolume().GetCapacityBytes() < requested.Value() {
		// The claim would never bind; the volume is of no use.
		_ = p.deleteVolume(ctx, resp.GetVolume().GetVolumeId()) // it logs a failure
		return nil, controller.ProvisioningFinished, fmt.Errorf("volume of %d bytes is smaller than the %d requested", resp.GetVolume().GetCapacityBytes(), requested.Value())
	}
	pv := buildPV(pvSpec{
		name: o.PVName, driver: p.driver, identity: p.identity, class: class, pvc: pvc,
		fsType: fsType, requested: requested.Value(),
	}, resp.GetVolume())
	return pv, controller.ProvisioningFinished, nil
}

// createState tells the library whether a failed CreateVolume may still
// go on in the driver (retry with the same name), is final, or asks for
// another node.
func createState(err error, selectedNode bool) controller.ProvisioningState {
	switch status.Code(err) {
	case codes.ResourceExhausted:
		if selectedNode {
			return controller.ProvisioningReschedule
		}
		return controller.ProvisioningFinished
	case codes.Canceled, codes.DeadlineExceeded, codes.Unavailable, codes.Aborted:
		return controller.ProvisioningInBackground
	}
	return controller.ProvisioningFinished
}

func (p *provisioner) deleteVolume(ctx context.Context, id string) error {
	cctx, cancel := context.WithTimeout(ctx, p.opts.timeout)
	defer cancel()
	_, err := p.csi.DeleteVolume(cctx, &csi.DeleteVolumeRequest{VolumeId: id})
	if err != nil {
		p.log.Warn("DeleteVolume failed", "volume_id", id, "error", err)
		return fmt.Errorf("DeleteVolume %s: %w", id, err)
	}
	p.log.Info("volume deleted", "volume_id", id)
	return nil
}

func (p *provisioner) Delete(ctx context.Context, pv *corev1.PersistentVolume) error {
	src := pv.Spec.CSI
	if src == nil || src.Driver != p.driver {
		return &controller.IgnoredError{Reason: "not a volume of " + p.driver}
	}
	return p.deleteVolume(ctx, src.VolumeHandle)
}
