package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"
)

// Labels of the CSIStorageCapacity objects this provisioner manages, as
// the external-provisioner sets them.
const (
	labelDriver    = "csi.storage.k8s.io/drivername"
	labelManagedBy = "csi.storage.k8s.io/managed-by"
	managedBy      = "external-provisioner"
)

// capacity keeps one CSIStorageCapacity per (StorageClass of the driver,
// topology segment of a node with the driver), refreshed every period
// and whenever a StorageClass or CSINode changes.
type capacity struct {
	log    *slog.Logger
	kube   kubernetes.Interface
	csi    csi.ControllerClient
	driver string
	opts   options
	period time.Duration
}

// capacityKey identifies the object of one class and segment.
type capacityKey struct {
	class, segment string
}

func keyOf(c *storagev1.CSIStorageCapacity) (capacityKey, bool) {
	if c.NodeTopology == nil || len(c.NodeTopology.MatchExpressions) > 0 {
		return capacityKey{}, false
	}
	return capacityKey{c.StorageClassName, segmentString(c.NodeTopology.MatchLabels)}, true
}

// desiredCapacity is one object's content before its owner and name.
type desiredCapacity struct {
	class      string
	segment    map[string]string
	capacity   int64
	maxVolSize *int64
}

// capacityObject makes the object for d in namespace.
func capacityObject(d desiredCapacity, namespace, driver string, owner *metav1.OwnerReference) *storagev1.CSIStorageCapacity {
	c := &storagev1.CSIStorageCapacity{
		ObjectMeta: metav1.ObjectMeta{
			GenerateName: "csisc-",
			Namespace:    namespace,
			Labels:       map[string]string{labelDriver: driver, labelManagedBy: managedBy},
		},
		StorageClassName: d.class,
		NodeTopology:     &metav1.LabelSelector{MatchLabels: maps.Clone(d.segment)},
		Capacity:         resource.NewQuantity(d.capacity, resource.BinarySI),
	}
	if d.maxVolSize != nil {
		c.MaximumVolumeSize = resource.NewQuantity(*d.maxVolSize, resource.BinarySI)
	}
	if owner != nil {
		c.OwnerReferences = []metav1.OwnerReference{*owner}
	}
	return c
}

// sameContent reports whether existing already says what want says.
func sameContent(existing, want *storagev1.CSIStorageCapacity) bool {
	q := func(a, b *resource.Quantity) bool {
		if a == nil || b == nil {
			return a == b
		}
		return a.Cmp(*b) == 0
	}
	owners := func(a, b []metav1.OwnerReference) bool {
		if len(a) != len(b) {
			return false
		}
		for i := range a {
			if a[i].UID != b[i].UID {
				return false
			}
		}
		return true
	}
	return q(existing.Capacity, want.Capacity) && q(existing.MaximumVolumeSize, want.MaximumVolumeSize) &&
		owners(existing.OwnerReferences, want.OwnerReferences)
}

// owner walks opts.ownerRefLevel controller references up from the pod
// $POD_NAME: 0 is the pod, 1 its ReplicaSet (or StatefulSet,
// DaemonSet), 2 the ReplicaSet's Deployment. nil for level -1.
func owner(ctx context.Context, kube kubernetes.Interface, namespace, podName string, level int) (*metav1.OwnerReference, error) {
	if level < 0 {
		return nil, nil
	}
	pod, err := kube.CoreV1().Pods(namespace).Get(ctx, podName, metav1.GetOptions{})
	if err != nil {
		return nil, err
	}
	ref := metav1.OwnerReference{APIVersion: "v1", Kind: "Pod", Name: pod.Name, UID: pod.UID}
	refs := pod.OwnerReferences
	for i := 0; i < level; i++ {
		next := metav1.GetControllerOfNoCopy(&metav1.ObjectMeta{OwnerReferences: refs})
		if next == nil {
			return nil, fmt.Errorf("%s %s has no controller", ref.Kind, ref.Name)
		}
		ref = *next
		if i == level-1 {
			break
		}
		switch ref.Kind {
		case "ReplicaSet":
			rs, err := kube.AppsV1().ReplicaSets(namespace).Get(ctx, ref.Name, metav1.GetOptions{})
			if err != nil {
				return nil, err
			}
			refs = rs.OwnerReferences
		default:
			return nil, fmt.Errorf("cannot look above %s %s", ref.Kind, ref.Name)
		}
	}
	t := true
	ref.Controller, ref.BlockOwnerDeletion = &t, nil
	return &ref, nil
}

func (c *capacity) run(ctx context.Context) {
	own, err := owner(ctx, c.kube, c.opts.namespace, c.opts.podName, c.opts.ownerRefLevel)
	if err != nil {
		c.log.Warn("CSIStorageCapacity objects get no owner", "error", err)
		own = nil
	} else if own != nil {
		c.log.Info("CSIStorageCapacity owner", "kind", own.Kind, "name", own.Name)
	}

	kick := make(chan struct{}, 1)
	poke := func() {
		select {
		case kick <- struct{}{}:
		default:
		}
	}
	h := cache.ResourceEventHandlerFuncs{
		AddFunc:    func(any) { poke() },
		UpdateFunc: func(any, any) { poke() },
		DeleteFunc: func(any) { poke() },
	}
	f := informers.NewSharedInformerFactory(c.kube, 0)
	if _, err := f.Storage().V1().StorageClasses().Informer().AddEventHandler(h); err != nil {
		c.log.Error("watch StorageClasses", "error", err)
	}
	if _, err := f.Storage().V1().CSINodes().Informer().AddEventHandler(h); err != nil {
		c.log.Error("watch CSINodes", "error", err)
	}
	f.Start(ctx.Done())
	defer f.Shutdown()

	t := time.NewTicker(c.period)
	defer t.Stop()
	for {
		if err := c.sync(ctx, own); err != nil && ctx.Err() == nil {
			c.log.Warn("capacity sync", "error", err)
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		case <-kick:
		}
	}
}

// desired asks GetCapacity for every class of the driver and segment.
func (c *capacity) desired(ctx context.Context) (map[capacityKey]desiredCapacity, error) {
	classes, err := c.kube.StorageV1().StorageClasses().List(ctx, metav1.ListOptions{})
	if err != nil {
		return nil, err
	}
	segs, err := driverSegments(ctx, c.kube, c.driver)
	if err != nil {
		return nil, err
	}
	out := map[capacityKey]desiredCapacity{}
	var errs []error
	for i := range classes.Items {
		sc := &classes.Items[i]
		if sc.Provisioner != c.driver {
			continue
		}
		for _, seg := range segs {
			cctx, cancel := context.WithTimeout(ctx, c.opts.timeout)
			resp, err := c.csi.GetCapacity(cctx, &csi.GetCapacityRequest{
				Parameters:         createParams(sc.Parameters, nil, "", false),
				AccessibleTopology: &csi.Topology{Segments: seg},
			})
			cancel()
			if err != nil {
				errs = append(errs, fmt.Errorf("GetCapacity class %s segment %v: %w", sc.Name, seg, err))
				continue
			}
			d := desiredCapacity{class: sc.Name, segment: seg, capacity: resp.GetAvailableCapacity()}
			if m := resp.GetMaximumVolumeSize(); m != nil {
				v := m.GetValue()
				d.maxVolSize = &v
			}
			out[capacityKey{sc.Name, segmentString(seg)}] = d
		}
	}
	return out, errors.Join(errs...)
}

// sync makes the objects match what the driver reports. An object whose
// GetCapacity failed this round is kept as it is.
func (c *capacity) sync(ctx context.Context, own *metav1.OwnerReference) error {
	want, derr := c.desired(ctx)
	ns := c.kube.StorageV1().CSIStorageCapacities(c.opts.namespace)
	list, err := ns.List(ctx, metav1.ListOptions{LabelSelector: labelDriver + "=" + c.driver + "," + labelManagedBy + "=" + managedBy})
	if err != nil {
		return errors.Join(derr, err)
	}
	errs := []error{derr}
	seen := map[capacityKey]bool{}
	for i := range list.Items {
		ex := &list.Items[i]
		k, ok := keyOf(ex)
		d, wanted := want[k]
		if !ok || seen[k] || (!wanted && !c.stillExists(ctx, k)) {
			if err := ns.Delete(ctx, ex.Name, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
				errs = append(errs, err)
			} else {
				c.log.Info("CSIStorageCapacity deleted", "name", ex.Name, "storage_class", ex.StorageClassName)
			}
			continue
		}
		seen[k] = true
		if !wanted {
			continue // GetCapacity failed this round: keep the last value
		}
		obj := capacityObject(d, c.opts.namespace, c.driver, own)
		if sameContent(ex, obj) {
			continue
		}
		up := ex.DeepCopy()
		up.Capacity, up.MaximumVolumeSize, up.OwnerReferences = obj.Capacity, obj.MaximumVolumeSize, obj.OwnerReferences
		if _, err := ns.Update(ctx, up, metav1.UpdateOptions{}); err != nil {
			errs = append(errs, err)
			continue
		}
		c.log.Debug("CSIStorageCapacity updated", "name", ex.Name, "capacity", obj.Capacity.String())
	}
	for k, d := range want {
		if seen[k] {
			continue
		}
		made, err := ns.Create(ctx, capacityObject(d, c.opts.namespace, c.driver, own), metav1.CreateOptions{})
		if err != nil {
			errs = append(errs, err)
			continue
		}
		c.log.Info("CSIStorageCapacity created", "name", made.Name, "storage_class", d.class, "segment", d.segment, "capacity", made.Capacity.String())
	}
	return errors.Join(errs...)
}

// stillExists reports whether the class and segment of k still exist, so
// an object whose GetCapacity failed is kept only while they do.
func (c *capacity) stillExists(ctx context.Context, k capacityKey) bool {
	sc, err := c.kube.StorageV1().StorageClasses().Get(ctx, k.class, metav1.GetOptions{})
	if err != nil || sc.Provisioner != c.driver {
		return false
	}
	segs, err := driverSegments(ctx, c.kube, c.driver)
	if err != nil {
		return true
	}
	for _, s := range segs {
		if segmentString(s) == k.segment {
			return true
		}
	}
	return false
}
