package main

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/protobuf/types/known/wrapperspb"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/utils/ptr"

	"github.com/mpnbd/mpnbd/e2e/apiserver"
	"github.com/mpnbd/mpnbd/e2e/standins/internal/fakecsi"
	"github.com/mpnbd/mpnbd/e2e/standins/internal/sidecar"
)

const (
	topoKey = "topology.mpnbd.io/storage-network"
	ns      = "mpnbd-system"
)

// eventually polls cond every 200ms until it is nil or a generous
// deadline passes.
func eventually(t *testing.T, what string, cond func() error) {
	t.Helper()
	deadline := time.Now().Add(90 * time.Second)
	for {
		err := cond()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: %v", what, err)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

func must[T any](t *testing.T) func(T, error) T {
	return func(v T, err error) T {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
		return v
	}
}

// controllerPod makes Deployment -> ReplicaSet -> Pod in ns, as the
// chart's controller runs, and returns the pod's name.
func controllerPod(t *testing.T, ctx context.Context, kube kubernetes.Interface) (podName string, deploy *appsv1.Deployment) {
	labels := map[string]string{"app": "ctl"}
	tmpl := corev1.PodTemplateSpec{
		ObjectMeta: metav1.ObjectMeta{Labels: labels},
		Spec:       corev1.PodSpec{Containers: []corev1.Container{{Name: "c", Image: "x"}}},
	}
	deploy = must[*appsv1.Deployment](t)(kube.AppsV1().Deployments(ns).Create(ctx, &appsv1.Deployment{
		ObjectMeta: metav1.ObjectMeta{Name: "ctl"},
		Spec:       appsv1.DeploymentSpec{Selector: &metav1.LabelSelector{MatchLabels: labels}, Template: tmpl},
	}, metav1.CreateOptions{}))
	rs := must[*appsv1.ReplicaSet](t)(kube.AppsV1().ReplicaSets(ns).Create(ctx, &appsv1.ReplicaSet{
		ObjectMeta: metav1.ObjectMeta{Name: "ctl-5d8f", OwnerReferences: []metav1.OwnerReference{{
			APIVersion: "apps/v1", Kind: "Deployment", Name: deploy.Name, UID: deploy.UID, Controller: ptr.To(true),
		}}},
		Spec: appsv1.ReplicaSetSpec{Selector: &metav1.LabelSelector{MatchLabels: labels}, Template: tmpl},
	}, metav1.CreateOptions{}))
	pod := must[*corev1.Pod](t)(kube.CoreV1().Pods(ns).Create(ctx, &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "ctl-5d8f-x1", Labels: labels, OwnerReferences: []metav1.OwnerReference{{
			APIVersion: "apps/v1", Kind: "ReplicaSet", Name: rs.Name, UID: rs.UID, Controller: ptr.To(true),
		}}},
		Spec: tmpl.Spec,
	}, metav1.CreateOptions{}))
	return pod.Name, deploy
}

// storageNode makes a Node labelled with segment value net and, with
// driver, its CSINode listing driver with the topology key.
func storageNode(t *testing.T, ctx context.Context, kube kubernetes.Interface, name, net, driver string) {
	must[*corev1.Node](t)(kube.CoreV1().Nodes().Create(ctx, &corev1.Node{
		ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{topoKey: net}},
	}, metav1.CreateOptions{}))
	cn := &storagev1.CSINode{ObjectMeta: metav1.ObjectMeta{Name: name}}
	if driver != "" {
		cn.Spec.Drivers = []storagev1.CSINodeDriver{{Name: driver, NodeID: name, TopologyKeys: []string{topoKey}}}
	}
	must[*storagev1.CSINode](t)(kube.StorageV1().CSINodes().Create(ctx, cn, metav1.CreateOptions{}))
}

// TestProvisionerAgainstAPIServer runs the stand-in with the chart's
// flags against a real API server and a fake plugin: a WaitForFirstConsumer
// claim on a selected node becomes a PV of that node's segment, a released
// PV is deleted through DeleteVolume, and CSIStorageCapacity objects
// follow the classes and segments, owned by the Deployment.
func TestProvisionerAgainstAPIServer(t *testing.T) {
	cfg, _ := apiserver.Start(t)
	kube := must[*kubernetes.Clientset](t)(kubernetes.NewForConfig(cfg))
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()

	for _, n := range []string{ns, "app"} {
		must[*corev1.Namespace](t)(kube.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: n}}, metav1.CreateOptions{}))
		must[*corev1.ServiceAccount](t)(kube.CoreV1().ServiceAccounts(n).Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "default"}}, metav1.CreateOptions{}))
	}
	podName, deploy := controllerPod(t, ctx, kube)
	storageNode(t, ctx, kube, "n1", "a", testDriver)
	storageNode(t, ctx, kube, "n2", "b", testDriver)
	storageNode(t, ctx, kube, "n3", "c", "")
	wffc := storagev1.VolumeBindingWaitForFirstConsumer
	must[*storagev1.StorageClass](t)(kube.StorageV1().StorageClasses().Create(ctx, &storagev1.StorageClass{
		ObjectMeta:        metav1.ObjectMeta{Name: "mpnbd"},
		Provisioner:       testDriver,
		Parameters:        map[string]string{"transport": "relay", "csi.storage.k8s.io/fstype": "xfs"},
		VolumeBindingMode: &wffc,
		MountOptions:      []string{"noatime"},
	}, metav1.CreateOptions{}))
	must[*storagev1.StorageClass](t)(kube.StorageV1().StorageClasses().Create(ctx, &storagev1.StorageClass{
		ObjectMeta: metav1.ObjectMeta{Name: "other"}, Provisioner: "other.example.com",
	}, metav1.CreateOptions{}))

	plugin := &fakecsi.Plugin{Name: testDriver, Topology: true, ControllerCaps: []csi.ControllerServiceCapability_RPC_Type{
		csi.ControllerServiceCapability_RPC_CREATE_DELETE_VOLUME,
		csi.ControllerServiceCapability_RPC_GET_CAPACITY,
		csi.ControllerServiceCapability_RPC_SINGLE_NODE_MULTI_WRITER,
	}}
	plugin.OnCreate(func(req *csi.CreateVolumeRequest) (*csi.CreateVolumeResponse, error) {
		var topo []*csi.Topology
		if r := req.GetAccessibilityRequirements(); r != nil && len(r.GetPreferred()) > 0 {
			topo = r.GetPreferred()[:1]
		}
		return &csi.CreateVolumeResponse{Volume: &csi.Volume{
			VolumeId: "vol-" + req.GetName(), CapacityBytes: req.GetCapacityRange().GetRequiredBytes(),
			VolumeContext: map[string]string{"transport": "relay"}, AccessibleTopology: topo,
		}}, nil
	})
	sizes := map[string]int64{"a": 10 << 30, "b": 20 << 30}
	plugin.OnCapacity(func(req *csi.GetCapacityRequest) (*csi.GetCapacityResponse, error) {
		if _, ok := req.GetParameters()["csi.storage.k8s.io/fstype"]; ok {
			return nil, errors.New("prefixed parameter passed to GetCapacity")
		}
		return &csi.GetCapacityResponse{
			AvailableCapacity: sizes[req.GetAccessibleTopology().GetSegments()[topoKey]],
			MaximumVolumeSize: wrapperspb.Int64(5 << 30),
		}, nil
	})
	sock := fakecsi.Serve(t, plugin)

	all, err := sidecar.ManifestArgs("deploy/controller.yaml", "csi-provisioner")
	if err != nil {
		t.Fatal(err)
	}
	args := append(slices.Clone(all[0]), "--csi-address="+sock, "--kubeconfig="+apiserver.WriteKubeconfig(t, cfg))
	o, err := parseFlags(args, env(map[string]string{"NAMESPACE": ns, "POD_NAME": podName}), fakecsi.NewLog(t))
	if err != nil {
		t.Fatal(err)
	}
	log := sidecar.NewLogger(fakecsi.NewLog(t), 4)
	done := make(chan error, 1)
	go func() { done <- run(ctx, log, o) }()
	defer func() {
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("run after the cancel: %v", err)
			}
		case <-time.After(30 * time.Second):
			t.Error("the provisioner did not stop")
		}
	}()

	// The provisioner library registers types in client-go's global
	// scheme when it starts, which our client reads: wait for the
	// capacity loop, which starts after it, before using the client.
	eventually(t, "first GetCapacity", func() error {
		if plugin.CapacityCalls() == 0 {
			return errors.New("none yet")
		}
		return nil
	})

	t.Run("capacity", func(t *testing.T) {
		eventually(t, "CSIStorageCapacity objects", func() error {
			list, err := kube.StorageV1().CSIStorageCapacities(ns).List(ctx, metav1.ListOptions{})
			if err != nil {
				return err
			}
			got := map[string]int64{}
			for _, c := range list.Items {
				if c.StorageClassName != "mpnbd" {
					return fmt.Errorf("object for class %s", c.StorageClassName)
				}
				if len(c.OwnerReferences) != 1 || c.OwnerReferences[0].UID != deploy.UID {
					return fmt.Errorf("%s owned by %v, want the Deployment", c.Name, c.OwnerReferences)
				}
				if c.MaximumVolumeSize == nil || c.MaximumVolumeSize.Value() != 5<<30 {
					return fmt.Errorf("%s maximumVolumeSize %v", c.Name, c.MaximumVolumeSize)
				}
				got[c.NodeTopology.MatchLabels[topoKey]] = c.Capacity.Value()
			}
			if len(got) != 2 || got["a"] != sizes["a"] || got["b"] != sizes["b"] || len(list.Items) != 2 {
				return fmt.Errorf("capacities by segment %v (%d objects)", got, len(list.Items))
			}
			return nil
		})
	})

	var pv *corev1.PersistentVolume
	t.Run("provision", func(t *testing.T) {
		fs := corev1.PersistentVolumeFilesystem
		pvc := must[*corev1.PersistentVolumeClaim](t)(kube.CoreV1().PersistentVolumeClaims("app").Create(ctx, &corev1.PersistentVolumeClaim{
			ObjectMeta: metav1.ObjectMeta{Name: "data", Annotations: map[string]string{
				"volume.kubernetes.io/storage-provisioner": testDriver,
				"volume.kubernetes.io/selected-node":       "n2",
			}},
			Spec: corev1.PersistentVolumeClaimSpec{
				StorageClassName: ptr.To("mpnbd"),
				AccessModes:      []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
				VolumeMode:       &fs,
				Resources:        corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("1Gi")}},
			},
		}, metav1.CreateOptions{}))
		name := "pvc-" + string(pvc.UID)
		eventually(t, "PV "+name, func() error {
			var err error
			pv, err = kube.CoreV1().PersistentVolumes().Get(ctx, name, metav1.GetOptions{})
			return err
		})
		src := pv.Spec.CSI
		if src == nil || src.Driver != testDriver || src.VolumeHandle != "vol-"+name || src.FSType != "xfs" || src.VolumeAttributes["transport"] != "relay" {
			t.Errorf("csi source %+v", src)
		}
		if pv.Spec.ClaimRef == nil || pv.Spec.ClaimRef.UID != pvc.UID || pv.Spec.StorageClassName != "mpnbd" ||
			pv.Spec.PersistentVolumeReclaimPolicy != corev1.PersistentVolumeReclaimDelete {
			t.Errorf("claim/class/reclaim: %+v", pv.Spec)
		}
		if q := pv.Spec.Capacity[corev1.ResourceStorage]; q.Value() != 1<<30 {
			t.Errorf("capacity %s", q.String())
		}
		if pv.Spec.NodeAffinity == nil || pv.Spec.NodeAffinity.Required.NodeSelectorTerms[0].MatchExpressions[0].Values[0] != "b" {
			t.Errorf("node affinity %+v, want segment b of the selected node", pv.Spec.NodeAffinity)
		}
		if pv.Annotations["pv.kubernetes.io/provisioned-by"] != testDriver {
			t.Errorf("annotations %v", pv.Annotations)
		}

		creates := plugin.Creates()
		if len(creates) == 0 {
			t.Fatal("no CreateVolume")
		}
		req := creates[0]
		if req.GetName() != name || req.GetCapacityRange().GetRequiredBytes() != 1<<30 {
			t.Errorf("name/capacity: %v", req)
		}
		p := req.GetParameters()
		if len(p) != 4 || p["transport"] != "relay" || p["csi.storage.k8s.io/pvc/name"] != "data" ||
			p["csi.storage.k8s.io/pvc/namespace"] != "app" || p["csi.storage.k8s.io/pv/name"] != name {
			t.Errorf("parameters %v", p)
		}
		if c := req.GetVolumeCapabilities(); len(c) != 1 || c[0].GetMount().GetFsType() != "xfs" ||
			c[0].GetAccessMode().GetMode() != csi.VolumeCapability_AccessMode_SINGLE_NODE_MULTI_WRITER ||
			len(c[0].GetMount().GetMountFlags()) != 1 {
			t.Errorf("capabilities %v", c)
		}
		r := req.GetAccessibilityRequirements()
		if len(r.GetRequisite()) != 1 || r.GetRequisite()[0].GetSegments()[topoKey] != "b" {
			t.Errorf("topology requirement %v", r)
		}
	})
	if pv == nil {
		t.FailNow()
	}

	t.Run("delete", func(t *testing.T) {
		// No PV controller runs here: release the volume by hand.
		pv.Status.Phase = corev1.VolumeReleased
		must[*corev1.PersistentVolume](t)(kube.CoreV1().PersistentVolumes().UpdateStatus(ctx, pv, metav1.UpdateOptions{}))
		eventually(t, "DeleteVolume", func() error {
			if d := plugin.Deletes(); !slices.Contains(d, pv.Spec.CSI.VolumeHandle) {
				return fmt.Errorf("deleted %v", d)
			}
			return nil
		})
		// The PV is deleted and the provisioner's finalizer removed; the
		// API server's kubernetes.io/pv-protection finalizer stays, as no
		// PV protection controller runs here.
		eventually(t, "PV deleted", func() error {
			got, err := kube.CoreV1().PersistentVolumes().Get(ctx, pv.Name, metav1.GetOptions{})
			if apierrors.IsNotFound(err) {
				return nil
			}
			if err != nil {
				return err
			}
			if got.DeletionTimestamp == nil || slices.Contains(got.Finalizers, "external-provisioner.volume.kubernetes.io/finalizer") {
				return fmt.Errorf("PV deletion %v, finalizers %v", got.DeletionTimestamp, got.Finalizers)
			}
			return nil
		})
	})

	t.Run("capacity follows classes", func(t *testing.T) {
		if err := kube.StorageV1().StorageClasses().Delete(ctx, "mpnbd", metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
		eventually(t, "stale CSIStorageCapacity deleted", func() error {
			list, err := kube.StorageV1().CSIStorageCapacities(ns).List(ctx, metav1.ListOptions{})
			if err != nil {
				return err
			}
			if len(list.Items) != 0 {
				return fmt.Errorf("%d objects left", len(list.Items))
			}
			return nil
		})
	})
}
