package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	corelisters "k8s.io/client-go/listers/core/v1"
	storagelisters "k8s.io/client-go/listers/storage/v1"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/util/workqueue"

	"github.com/mpnbd/mpnbd/e2e/standins/internal/sidecar"
)

// decision is what a claim needs from the resizer.
type decision struct {
	// expand: call ControllerExpandVolume (or, without the controller
	// capability, hand the new size to the kubelet) for size.
	expand bool
	size   resource.Quantity
	// why explains a claim left alone (for debug logs).
	why string
}

// decide looks at a claim and its volume. It expands a bound claim of
// the driver whose requested size exceeds its status capacity, unless the
// class forbids expansion or the kubelet already has that size to apply
// (NodeResizePending or NodeResizeInProgress).
func decide(pvc *corev1.PersistentVolumeClaim, pv *corev1.PersistentVolume, allowExpansion bool, driver string) decision {
	if pvc.Status.Phase != corev1.ClaimBound || pv == nil || pvc.Spec.VolumeName != pv.Name {
		return decision{why: "not bound"}
	}
	if pv.Spec.CSI == nil || pv.Spec.CSI.Driver != driver {
		return decision{why: "not a volume of " + driver}
	}
	want, ok := pvc.Spec.Resources.Requests[corev1.ResourceStorage]
	if !ok {
		return decision{why: "no storage request"}
	}
	have := pvc.Status.Capacity[corev1.ResourceStorage]
	if want.Cmp(have) <= 0 {
		return decision{why: "no larger size requested"}
	}
	if !allowExpansion {
		return decision{why: "the StorageClass does not allow expansion"}
	}
	switch pvc.Status.AllocatedResourceStatuses[corev1.ResourceStorage] {
	case corev1.PersistentVolumeClaimNodeResizePending, corev1.PersistentVolumeClaimNodeResizeInProgress:
		if alloc, ok := pvc.Status.AllocatedResources[corev1.ResourceStorage]; ok && alloc.Cmp(want) >= 0 {
			return decision{why: "waiting for the kubelet to expand on the node"}
		}
	}
	return decision{expand: true, size: want}
}

// resizeConditions are the claim conditions the resizers own.
var resizeConditions = map[corev1.PersistentVolumeClaimConditionType]bool{
	corev1.PersistentVolumeClaimResizing:                true,
	corev1.PersistentVolumeClaimFileSystemResizePending: true,
	corev1.PersistentVolumeClaimControllerResizeError:   true,
	corev1.PersistentVolumeClaimNodeResizeError:         true,
}

// withResizeConditions keeps the claim's other conditions and puts set in
// place of its resize conditions (an existing one of the same type and
// status keeps its transition time).
func withResizeConditions(old []corev1.PersistentVolumeClaimCondition, set ...corev1.PersistentVolumeClaimCondition) []corev1.PersistentVolumeClaimCondition {
	out := []corev1.PersistentVolumeClaimCondition{}
	for _, c := range old {
		if !resizeConditions[c.Type] {
			out = append(out, c)
		}
	}
	for _, n := range set {
		for _, c := range old {
			if c.Type == n.Type && c.Status == n.Status {
				n.LastTransitionTime = c.LastTransitionTime
			}
		}
		out = append(out, n)
	}
	return out
}

// The claim status steps, as the external-resizer takes them with
// RecoverVolumeExpansionFailure (GA in Kubernetes 1.34): the kubelet
// expands on the node only while allocatedResourceStatuses[storage] is
// NodeResizePending, and then sets status.capacity itself.
type step int

const (
	// stepControllerInProgress: allocatedResources = size, status
	// ControllerResizeInProgress, condition Resizing.
	stepControllerInProgress step = iota
	// stepNodePending: status NodeResizePending, condition
	// FileSystemResizePending.
	stepNodePending
	// stepFinished: capacity = size, status and resize conditions cleared.
	stepFinished
)

// statusPatch is the JSON merge patch of the claim's status for step.
func statusPatch(pvc *corev1.PersistentVolumeClaim, s step, size resource.Quantity, now metav1.Time) ([]byte, error) {
	st := map[string]any{}
	cond := func(t corev1.PersistentVolumeClaimConditionType, msg string) corev1.PersistentVolumeClaimCondition {
		return corev1.PersistentVolumeClaimCondition{Type: t, Status: corev1.ConditionTrue, LastTransitionTime: now, Message: msg}
	}
	switch s {
	case stepControllerInProgress:
		st["allocatedResources"] = map[string]any{string(corev1.ResourceStorage): size.String()}
		st["allocatedResourceStatuses"] = map[string]any{string(corev1.ResourceStorage): corev1.PersistentVolumeClaimControllerResizeInProgress}
		st["conditions"] = withResizeConditions(pvc.Status.Conditions, cond(corev1.PersistentVolumeClaimResizing, ""))
	case stepNodePending:
		st["allocatedResources"] = map[string]any{string(corev1.ResourceStorage): size.String()}
		st["allocatedResourceStatuses"] = map[string]any{string(corev1.ResourceStorage): corev1.PersistentVolumeClaimNodeResizePending}
		st["conditions"] = withResizeConditions(pvc.Status.Conditions, cond(corev1.PersistentVolumeClaimFileSystemResizePending,
			"Waiting for user to (re-)start a pod to finish file system resize of volume on node."))
	case stepFinished:
		st["capacity"] = map[string]any{string(corev1.ResourceStorage): size.String()}
		st["allocatedResourceStatuses"] = map[string]any{string(corev1.ResourceStorage): nil}
		st["conditions"] = withResizeConditions(pvc.Status.Conditions)
	default:
		return nil, fmt.Errorf("unknown step %d", s)
	}
	return json.Marshal(map[string]any{"status": st})
}

// pvCapability is the capability the volume is used with, from its PV.
func pvCapability(pv *corev1.PersistentVolume, singleNodeMultiWriter bool) (*csi.VolumeCapability, error) {
	c := &csi.VolumeCapability{AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER}}
	if len(pv.Spec.AccessModes) > 0 {
		m, err := sidecar.AccessMode(pv.Spec.AccessModes[0], singleNodeMultiWriter)
		if err != nil {
			return nil, err
		}
		c.AccessMode.Mode = m
	}
	if pv.Spec.VolumeMode != nil && *pv.Spec.VolumeMode == corev1.PersistentVolumeBlock {
		c.AccessType = &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}}
	} else {
		c.AccessType = &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{
			FsType: pv.Spec.CSI.FSType, MountFlags: pv.Spec.MountOptions,
		}}
	}
	return c, nil
}

// resizer watches claims and expands the driver's volumes.
type resizer struct {
	log    *slog.Logger
	kube   kubernetes.Interface
	csi    csi.ControllerClient
	driver string
	opts   options
	// controllerExpand: the driver has EXPAND_VOLUME; without it only
	// the node expands.
	controllerExpand, singleNodeMultiWriter bool

	pvcs    corelisters.PersistentVolumeClaimLister
	pvs     corelisters.PersistentVolumeLister
	classes storagelisters.StorageClassLister
	queue   workqueue.TypedRateLimitingInterface[string]
}

func (r *resizer) run(ctx context.Context) error {
	f := informers.NewSharedInformerFactory(r.kube, 10*time.Minute)
	pvcInf := f.Core().V1().PersistentVolumeClaims()
	pvInf := f.Core().V1().PersistentVolumes()
	scInf := f.Storage().V1().StorageClasses()
	r.pvcs, r.pvs, r.classes = pvcInf.Lister(), pvInf.Lister(), scInf.Lister()
	r.queue = workqueue.NewTypedRateLimitingQueue(workqueue.DefaultTypedControllerRateLimiter[string]())
	defer r.queue.ShutDown()

	enqueue := func(obj any) {
		if k, err := cache.MetaNamespaceKeyFunc(obj); err == nil {
			r.queue.Add(k)
		}
	}
	if _, err := pvcInf.Informer().AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    enqueue,
		UpdateFunc: func(_, n any) { enqueue(n) },
	}); err != nil {
		return err
	}
	// A PV update (bound, capacity) re-examines its claim.
	if _, err := pvInf.Informer().AddEventHandler(cache.ResourceEventHandlerFuncs{
		UpdateFunc: func(_, n any) {
			if pv, ok := n.(*corev1.PersistentVolume); ok && pv.Spec.ClaimRef != nil {
				r.queue.Add(pv.Spec.ClaimRef.Namespace + "/" + pv.Spec.ClaimRef.Name)
			}
		},
	}); err != nil {
		return err
	}
	f.Start(ctx.Done())
	defer f.Shutdown()
	for typ, ok := range f.WaitForCacheSync(ctx.Done()) {
		if !ok {
			return fmt.Errorf("cache of %v did not sync", typ)
		}
	}
	r.log.Info("watching claims", "driver", r.driver, "controller_expand", r.controllerExpand)
	go func() {
		<-ctx.Done()
		r.queue.ShutDown()
	}()
	for r.next(ctx) {
	}
	return nil
}

func (r *resizer) next(ctx context.Context) bool {
	key, quit := r.queue.Get()
	if quit {
		return false
	}
	defer r.queue.Done(key)
	if err := r.sync(ctx, key); err != nil {
		r.log.Warn("resize failed, retrying", "pvc", key, "error", err)
		r.queue.AddRateLimited(key)
		return true
	}
	r.queue.Forget(key)
	return true
}

func (r *resizer) sync(ctx context.Context, key string) error {
	ns, name, err := cache.SplitMetaNamespaceKey(key)
	if err != nil {
		return nil
	}
	pvc, err := r.pvcs.PersistentVolumeClaims(ns).Get(name)
	if err != nil {
		return nil // deleted
	}
	if pvc.Spec.VolumeName == "" {
		return nil
	}
	pv, err := r.pvs.Get(pvc.Spec.VolumeName)
	if err != nil {
		return nil // the PV event brings the claim back
	}
	allow := false
	if pvc.Spec.StorageClassName != nil {
		if sc, err := r.classes.Get(*pvc.Spec.StorageClassName); err == nil {
			allow = sc.AllowVolumeExpansion != nil && *sc.AllowVolumeExpansion
		}
	}
	d := decide(pvc, pv, allow, r.driver)
	log := r.log.With("pvc", key, "pv", pv.Name)
	if d.expand {
		// The cache may lag behind our own last status patch: decide
		// again on the claim as the API server has it.
		if pvc, err = r.kube.CoreV1().PersistentVolumeClaims(ns).Get(ctx, name, metav1.GetOptions{}); err != nil {
			return err
		}
		d = decide(pvc, pv, allow, r.driver)
	}
	if !d.expand {
		log.Debug("nothing to resize", "why", d.why)
		return nil
	}
	return r.expand(ctx, log, pvc, pv, d.size)
}

// expand takes the claim through the controller expansion to the
// kubelet's node expansion or to the end.
func (r *resizer) expand(ctx context.Context, log *slog.Logger, pvc *corev1.PersistentVolumeClaim, pv *corev1.PersistentVolume, size resource.Quantity) error {
	pvc, err := r.patchStatus(ctx, pvc, stepControllerInProgress, size)
	if err != nil {
		return err
	}
	newSize, nodeRequired := size, true
	if r.controllerExpand {
		vcap, err := pvCapability(pv, r.singleNodeMultiWriter)
		if err != nil {
			return err
		}
		cctx, cancel := context.WithTimeout(ctx, r.opts.timeout)
		resp, err := r.csi.ControllerExpandVolume(cctx, &csi.ControllerExpandVolumeRequest{
			VolumeId:         pv.Spec.CSI.VolumeHandle,
			CapacityRange:    &csi.CapacityRange{RequiredBytes: size.Value()},
			VolumeCapability: vcap,
		})
		cancel()
		if err != nil {
			return fmt.Errorf("ControllerExpandVolume: %w", err)
		}
		if resp.GetCapacityBytes() > 0 {
			if resp.GetCapacityBytes() < size.Value() {
				return fmt.Errorf("ControllerExpandVolume gave %d bytes, %d were asked", resp.GetCapacityBytes(), size.Value())
			}
			newSize = *resource.NewQuantity(resp.GetCapacityBytes(), resource.BinarySI)
		}
		nodeRequired = resp.GetNodeExpansionRequired()
		log.Info("volume expanded", "volume_id", pv.Spec.CSI.VolumeHandle, "capacity_bytes", newSize.Value(), "node_expansion_required", nodeRequired)
	}
	if cur := pv.Spec.Capacity[corev1.ResourceStorage]; cur.Cmp(newSize) < 0 {
		patch, err := json.Marshal(map[string]any{"spec": map[string]any{"capacity": map[string]any{string(corev1.ResourceStorage): newSize.String()}}})
		if err != nil {
			return err
		}
		if _, err := r.kube.CoreV1().PersistentVolumes().Patch(ctx, pv.Name, types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
			return fmt.Errorf("PV capacity: %w", err)
		}
	}
	if nodeRequired {
		_, err = r.patchStatus(ctx, pvc, stepNodePending, newSize)
		if err == nil {
			log.Info("node expansion pending", "size", newSize.String())
		}
		return err
	}
	_, err = r.patchStatus(ctx, pvc, stepFinished, newSize)
	if err == nil {
		log.Info("resize finished", "size", newSize.String())
	}
	return err
}

func (r *resizer) patchStatus(ctx context.Context, pvc *corev1.PersistentVolumeClaim, s step, size resource.Quantity) (*corev1.PersistentVolumeClaim, error) {
	patch, err := statusPatch(pvc, s, size, metav1.Now())
	if err != nil {
		return nil, err
	}
	out, err := r.kube.CoreV1().PersistentVolumeClaims(pvc.Namespace).Patch(ctx, pvc.Name, types.MergePatchType, patch, metav1.PatchOptions{}, "status")
	if err != nil {
		return nil, fmt.Errorf("claim status: %w", err)
	}
	return out, nil
}

var errNoExpand = errors.New("the driver cannot expand volumes")
