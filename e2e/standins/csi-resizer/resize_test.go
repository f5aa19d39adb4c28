package main

import (
	"encoding/json"
	"io"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/mpnbd/mpnbd/e2e/standins/internal/sidecar"
)

const testDriver = "nbd.mptcp.mpnbd.io"

func TestParseFlagsChartArgs(t *testing.T) {
	all, err := sidecar.ManifestArgs("deploy/controller.yaml", "csi-resizer")
	if err != nil {
		t.Fatal(err)
	}
	for _, args := range all {
		o, err := parseFlags(args, io.Discard)
		if err != nil {
			t.Fatalf("chart args %q: %v", args, err)
		}
		if o.csiAddress != "/csi/csi.sock" || !o.leaderElection || o.timeout != 120*time.Second || o.verbosity != 2 {
			t.Errorf("chart args %q parsed as %+v", args, o)
		}
	}
	for _, args := range [][]string{{"--handle-volume-inuse-error=false"}, {"--timeout=-1s"}, {"x"}} {
		if _, err := parseFlags(args, io.Discard); err == nil {
			t.Errorf("%q accepted", args)
		}
	}
}

func claimAndVolume(request, capacity string) (*corev1.PersistentVolumeClaim, *corev1.PersistentVolume) {
	pvc := &corev1.PersistentVolumeClaim{
		ObjectMeta: metav1.ObjectMeta{Name: "data", Namespace: "app"},
		Spec: corev1.PersistentVolumeClaimSpec{
			VolumeName: "pv-1",
			Resources:  corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: resource.MustParse(request)}},
		},
		Status: corev1.PersistentVolumeClaimStatus{Phase: corev1.ClaimBound, Capacity: corev1.ResourceList{corev1.ResourceStorage: resource.MustParse(capacity)}},
	}
	pv := &corev1.PersistentVolume{
		ObjectMeta: metav1.ObjectMeta{Name: "pv-1"},
		Spec: corev1.PersistentVolumeSpec{
			Capacity:               corev1.ResourceList{corev1.ResourceStorage: resource.MustParse(capacity)},
			PersistentVolumeSource: corev1.PersistentVolumeSource{CSI: &corev1.CSIPersistentVolumeSource{Driver: testDriver, VolumeHandle: "vol-1"}},
		},
	}
	return pvc, pv
}

func TestDecide(t *testing.T) {
	type tc struct {
		name   string
		change func(*corev1.PersistentVolumeClaim, *corev1.PersistentVolume)
		allow  bool
		expand bool
	}
	for _, c := range []tc{
		{"larger request", nil, true, true},
		{"class forbids", nil, false, false},
		{"same size", func(pvc *corev1.PersistentVolumeClaim, _ *corev1.PersistentVolume) {
			pvc.Spec.Resources.Requests[corev1.ResourceStorage] = resource.MustParse("1Gi")
		}, true, false},
		{"not bound", func(pvc *corev1.PersistentVolumeClaim, _ *corev1.PersistentVolume) {
			pvc.Status.Phase = corev1.ClaimPending
		}, true, false},
		{"other driver", func(_ *corev1.PersistentVolumeClaim, pv *corev1.PersistentVolume) { pv.Spec.CSI.Driver = "other" }, true, false},
		{"not CSI", func(_ *corev1.PersistentVolumeClaim, pv *corev1.PersistentVolume) { pv.Spec.CSI = nil }, true, false},
		{"other PV", func(pvc *corev1.PersistentVolumeClaim, _ *corev1.PersistentVolume) { pvc.Spec.VolumeName = "pv-2" }, true, false},
		{"node pending at that size", func(pvc *corev1.PersistentVolumeClaim, _ *corev1.PersistentVolume) {
			pvc.Status.AllocatedResources = corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("2Gi")}
			pvc.Status.AllocatedResourceStatuses = map[corev1.ResourceName]corev1.ClaimResourceStatus{corev1.ResourceStorage: corev1.PersistentVolumeClaimNodeResizePending}
		}, true, false},
		{"node in progress, then asked for more", func(pvc *corev1.PersistentVolumeClaim, _ *corev1.PersistentVolume) {
			pvc.Status.AllocatedResources = corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("1500Mi")}
			pvc.Status.AllocatedResourceStatuses = map[corev1.ResourceName]corev1.ClaimResourceStatus{corev1.ResourceStorage: corev1.PersistentVolumeClaimNodeResizeInProgress}
		}, true, true},
		{"controller resize interrupted", func(pvc *corev1.PersistentVolumeClaim, _ *corev1.PersistentVolume) {
			pvc.Status.AllocatedResources = corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("2Gi")}
			pvc.Status.AllocatedResourceStatuses = map[corev1.ResourceName]corev1.ClaimResourceStatus{corev1.ResourceStorage: corev1.PersistentVolumeClaimControllerResizeInProgress}
		}, true, true},
	} {
		pvc, pv := claimAndVolume("2Gi", "1Gi")
		if c.change != nil {
			c.change(pvc, pv)
		}
		d := decide(pvc, pv, c.allow, testDriver)
		if d.expand != c.expand {
			t.Errorf("%s: expand=%v (%s), want %v", c.name, d.expand, d.why, c.expand)
		}
		if d.expand && d.size.Cmp(pvc.Spec.Resources.Requests[corev1.ResourceStorage]) != 0 {
			t.Errorf("%s: size %s", c.name, d.size.String())
		}
	}
}

func TestStatusPatch(t *testing.T) {
	pvc, _ := claimAndVolume("2Gi", "1Gi")
	pvc.Status.Conditions = []corev1.PersistentVolumeClaimCondition{
		{Type: "Other", Status: corev1.ConditionTrue},
		{Type: corev1.PersistentVolumeClaimResizing, Status: corev1.ConditionTrue},
	}
	now := metav1.Now()
	decode := func(s step) map[string]any {
		t.Helper()
		b, err := statusPatch(pvc, s, resource.MustParse("2Gi"), now)
		if err != nil {
			t.Fatal(err)
		}
		var m map[string]map[string]any
		if err := json.Unmarshal(b, &m); err != nil {
			t.Fatal(err)
		}
		return m["status"]
	}
	condTypes := func(st map[string]any) []string {
		var out []string
		for _, c := range st["conditions"].([]any) {
			out = append(out, c.(map[string]any)["type"].(string))
		}
		return out
	}

	st := decode(stepControllerInProgress)
	if st["allocatedResources"].(map[string]any)["storage"] != "2Gi" ||
		st["allocatedResourceStatuses"].(map[string]any)["storage"] != "ControllerResizeInProgress" || st["capacity"] != nil {
		t.Errorf("controller step: %v", st)
	}
	if got := condTypes(st); len(got) != 2 || got[0] != "Other" || got[1] != "Resizing" {
		t.Errorf("controller step conditions %v", got)
	}

	st = decode(stepNodePending)
	if st["allocatedResourceStatuses"].(map[string]any)["storage"] != "NodeResizePending" || st["allocatedResources"].(map[string]any)["storage"] != "2Gi" {
		t.Errorf("node step: %v", st)
	}
	if got := condTypes(st); len(got) != 2 || got[1] != "FileSystemResizePending" {
		t.Errorf("node step conditions %v", got)
	}

	st = decode(stepFinished)
	rs, ok := st["allocatedResourceStatuses"].(map[string]any)
	if v, present := rs["storage"]; !ok || !present || v != nil {
		t.Errorf("finished: the storage status must be removed (null): %v", st)
	}
	if st["capacity"].(map[string]any)["storage"] != "2Gi" {
		t.Errorf("finished capacity: %v", st)
	}
	if got := condTypes(st); len(got) != 1 || got[0] != "Other" {
		t.Errorf("finished conditions %v", got)
	}
}

func TestPVCapability(t *testing.T) {
	_, pv := claimAndVolume("1Gi", "1Gi")
	pv.Spec.AccessModes = []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce}
	pv.Spec.CSI.FSType = "xfs"
	c, err := pvCapability(pv, true)
	if err != nil {
		t.Fatal(err)
	}
	if c.GetMount().GetFsType() != "xfs" || c.GetAccessMode().GetMode() != csi.VolumeCapability_AccessMode_SINGLE_NODE_MULTI_WRITER {
		t.Errorf("mount capability %v", c)
	}
	block := corev1.PersistentVolumeBlock
	pv.Spec.VolumeMode = &block
	pv.Spec.AccessModes = []corev1.PersistentVolumeAccessMode{corev1.ReadWriteMany}
	if c, _ = pvCapability(pv, true); c.GetBlock() == nil || c.GetAccessMode().GetMode() != csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER {
		t.Errorf("block capability %v", c)
	}
}
