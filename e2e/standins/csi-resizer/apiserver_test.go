package main

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/utils/ptr"

	"github.com/mpnbd/mpnbd/e2e/apiserver"
	"github.com/mpnbd/mpnbd/e2e/standins/internal/fakecsi"
	"github.com/mpnbd/mpnbd/e2e/standins/internal/sidecar"
)

// eventually polls cond until it is nil or a generous deadline passes.
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

// boundClaim makes a PV of the driver and its bound claim of 1Gi in
// namespace app.
func boundClaim(t *testing.T, ctx context.Context, kube kubernetes.Interface, name string, mode corev1.PersistentVolumeMode) *corev1.PersistentVolumeClaim {
	t.Helper()
	one := resource.MustParse("1Gi")
	pv := &corev1.PersistentVolume{
		ObjectMeta: metav1.ObjectMeta{Name: "pv-" + name},
		Spec: corev1.PersistentVolumeSpec{
			Capacity:                      corev1.ResourceList{corev1.ResourceStorage: one},
			AccessModes:                   []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
			VolumeMode:                    &mode,
			StorageClassName:              "mpnbd",
			PersistentVolumeReclaimPolicy: corev1.PersistentVolumeReclaimDelete,
			ClaimRef:                      &corev1.ObjectReference{Namespace: "app", Name: name},
			PersistentVolumeSource: corev1.PersistentVolumeSource{CSI: &corev1.CSIPersistentVolumeSource{
				Driver: testDriver, VolumeHandle: "vol-" + name, FSType: "ext4",
			}},
		},
	}
	if mode == corev1.PersistentVolumeBlock {
		pv.Spec.CSI.FSType = ""
	}
	if _, err := kube.CoreV1().PersistentVolumes().Create(ctx, pv, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	pvc, err := kube.CoreV1().PersistentVolumeClaims("app").Create(ctx, &corev1.PersistentVolumeClaim{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec: corev1.PersistentVolumeClaimSpec{
			VolumeName:       pv.Name,
			StorageClassName: ptr.To("mpnbd"),
			AccessModes:      []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
			VolumeMode:       &mode,
			Resources:        corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: one}},
		},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	// No PV controller runs here: bind by hand.
	pvc.Status = corev1.PersistentVolumeClaimStatus{
		Phase: corev1.ClaimBound, AccessModes: pvc.Spec.AccessModes,
		Capacity: corev1.ResourceList{corev1.ResourceStorage: one},
	}
	pvc, err = kube.CoreV1().PersistentVolumeClaims("app").UpdateStatus(ctx, pvc, metav1.UpdateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return pvc
}

func grow(t *testing.T, ctx context.Context, kube kubernetes.Interface, pvc *corev1.PersistentVolumeClaim, size string) {
	t.Helper()
	pvc = pvc.DeepCopy()
	pvc.Spec.Resources.Requests[corev1.ResourceStorage] = resource.MustParse(size)
	if _, err := kube.CoreV1().PersistentVolumeClaims("app").Update(ctx, pvc, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
}

// TestResizerAgainstAPIServer runs the stand-in with the chart's flags
// against a real API server and a fake plugin: a grown filesystem claim
// is expanded by the controller, its PV grows, and the claim waits for
// the kubelet (NodeResizePending); a block claim whose plugin needs no
// node expansion is done at once.
func TestResizerAgainstAPIServer(t *testing.T) {
	cfg, _ := apiserver.Start(t)
	kube, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	if _, err := kube.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "app"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := kube.StorageV1().StorageClasses().Create(ctx, &storagev1.StorageClass{
		ObjectMeta: metav1.ObjectMeta{Name: "mpnbd"}, Provisioner: testDriver, AllowVolumeExpansion: ptr.To(true),
	}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	fsClaim := boundClaim(t, ctx, kube, "fs", corev1.PersistentVolumeFilesystem)
	blockClaim := boundClaim(t, ctx, kube, "blk", corev1.PersistentVolumeBlock)

	plugin := &fakecsi.Plugin{Name: testDriver, Expansion: true, ControllerCaps: []csi.ControllerServiceCapability_RPC_Type{
		csi.ControllerServiceCapability_RPC_CREATE_DELETE_VOLUME,
		csi.ControllerServiceCapability_RPC_EXPAND_VOLUME,
		csi.ControllerServiceCapability_RPC_SINGLE_NODE_MULTI_WRITER,
	}}
	plugin.OnExpand(func(req *csi.ControllerExpandVolumeRequest) (*csi.ControllerExpandVolumeResponse, error) {
		return &csi.ControllerExpandVolumeResponse{
			CapacityBytes:         req.GetCapacityRange().GetRequiredBytes(),
			NodeExpansionRequired: req.GetVolumeId() == "vol-fs",
		}, nil
	})
	sock := fakecsi.Serve(t, plugin)

	all, err := sidecar.ManifestArgs("deploy/controller.yaml", "csi-resizer")
	if err != nil {
		t.Fatal(err)
	}
	args := append(slices.Clone(all[0]), "--csi-address="+sock, "--kubeconfig="+apiserver.WriteKubeconfig(t, cfg))
	o, err := parseFlags(args, fakecsi.NewLog(t))
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	log := sidecar.NewLogger(fakecsi.NewLog(t), 4) // sets klog: before any goroutine
	go func() { done <- run(ctx, log, o) }()
	defer func() {
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("resizer: %v", err)
			}
		case <-time.After(30 * time.Second):
			t.Error("the resizer did not stop")
		}
	}()

	two := resource.MustParse("2Gi")
	grow(t, ctx, kube, fsClaim, "2Gi")
	grow(t, ctx, kube, blockClaim, "2Gi")

	pvSize := func(name string) error {
		pv, err := kube.CoreV1().PersistentVolumes().Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		if q := pv.Spec.Capacity[corev1.ResourceStorage]; q.Cmp(two) != 0 {
			return fmt.Errorf("PV %s capacity %s", name, q.String())
		}
		return nil
	}

	t.Run("filesystem waits for the node", func(t *testing.T) {
		eventually(t, "NodeResizePending", func() error {
			pvc, err := kube.CoreV1().PersistentVolumeClaims("app").Get(ctx, "fs", metav1.GetOptions{})
			if err != nil {
				return err
			}
			st := pvc.Status
			if st.AllocatedResourceStatuses[corev1.ResourceStorage] != corev1.PersistentVolumeClaimNodeResizePending {
				return fmt.Errorf("status %v", st.AllocatedResourceStatuses)
			}
			if q := st.AllocatedResources[corev1.ResourceStorage]; q.Cmp(two) != 0 {
				return fmt.Errorf("allocated %s", q.String())
			}
			if q := st.Capacity[corev1.ResourceStorage]; q.Cmp(resource.MustParse("1Gi")) != 0 {
				return fmt.Errorf("capacity %s: the kubelet sets it after node expansion", q.String())
			}
			if !slices.ContainsFunc(st.Conditions, func(c corev1.PersistentVolumeClaimCondition) bool {
				return c.Type == corev1.PersistentVolumeClaimFileSystemResizePending && c.Status == corev1.ConditionTrue
			}) {
				return fmt.Errorf("conditions %v", st.Conditions)
			}
			return nil
		})
		if err := pvSize("pv-fs"); err != nil {
			t.Error(err)
		}
	})

	t.Run("block done by the controller", func(t *testing.T) {
		eventually(t, "claim capacity", func() error {
			pvc, err := kube.CoreV1().PersistentVolumeClaims("app").Get(ctx, "blk", metav1.GetOptions{})
			if err != nil {
				return err
			}
			if q := pvc.Status.Capacity[corev1.ResourceStorage]; q.Cmp(two) != 0 {
				return fmt.Errorf("capacity %s", q.String())
			}
			if _, ok := pvc.Status.AllocatedResourceStatuses[corev1.ResourceStorage]; ok {
				return fmt.Errorf("status left: %v", pvc.Status.AllocatedResourceStatuses)
			}
			for _, c := range pvc.Status.Conditions {
				if resizeConditions[c.Type] {
					return fmt.Errorf("resize condition left: %v", c)
				}
			}
			return nil
		})
		if err := pvSize("pv-blk"); err != nil {
			t.Error(err)
		}
	})

	var fsReq, blkReq *csi.ControllerExpandVolumeRequest
	for _, r := range plugin.Expands() {
		switch r.GetVolumeId() {
		case "vol-fs":
			fsReq = r
		case "vol-blk":
			blkReq = r
		}
	}
	if fsReq == nil || blkReq == nil {
		t.Fatalf("ControllerExpandVolume calls: %v", plugin.Expands())
	}
	if fsReq.GetCapacityRange().GetRequiredBytes() != two.Value() || fsReq.GetVolumeCapability().GetMount().GetFsType() != "ext4" ||
		fsReq.GetVolumeCapability().GetAccessMode().GetMode() != csi.VolumeCapability_AccessMode_SINGLE_NODE_MULTI_WRITER {
		t.Errorf("filesystem request %v", fsReq)
	}
	if blkReq.GetVolumeCapability().GetBlock() == nil {
		t.Errorf("block request %v", blkReq)
	}
	// Each claim is expanded once: the pending one is left to the kubelet.
	time.Sleep(time.Second)
	if n := len(plugin.Expands()); n != 2 {
		t.Errorf("%d ControllerExpandVolume calls, want 2", n)
	}
}
