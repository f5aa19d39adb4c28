package main

import (
	"errors"
	"io"
	"strings"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/sig-storage-lib-external-provisioner/v13/controller"

	"github.com/mpnbd/mpnbd/e2e/standins/internal/sidecar"
)

const testDriver = "nbd.mptcp.mpnbd.io"

func env(m map[string]string) func(string) string { return func(k string) string { return m[k] } }

func TestParseFlagsChartArgs(t *testing.T) {
	all, err := sidecar.ManifestArgs("deploy/controller.yaml", "csi-provisioner")
	if err != nil {
		t.Fatal(err)
	}
	for _, args := range all {
		o, err := parseFlags(args, env(map[string]string{"NAMESPACE": "mpnbd-system", "POD_NAME": "p"}), io.Discard)
		if err != nil {
			t.Fatalf("chart args %q: %v", args, err)
		}
		if o.csiAddress != "/csi/csi.sock" || !o.topology || !o.enableCapacity || !o.extraCreateMetadata ||
			o.ownerRefLevel != 2 || o.defaultFSType != "ext4" || o.timeout.Seconds() != 120 || o.verbosity != 2 {
			t.Errorf("chart args %q parsed as %+v", args, o)
		}
		if o.namespace != "mpnbd-system" || o.podName != "p" {
			t.Errorf("env: %+v", o)
		}
	}
}

func TestParseFlagsRejects(t *testing.T) {
	e := env(map[string]string{"NAMESPACE": "ns", "POD_NAME": "p"})
	for _, args := range [][]string{
		{"--unknown-flag"},
		{"--csi-address=/x", "--worker-threads=10"},
		{"--feature-gates=Bogus=true"},
		{"--feature-gates=Topology"},
		{"--feature-gates=Topology=maybe"},
		{"--timeout=0s"},
		{"--capacity-ownerref-level=-2"},
		{"positional"},
	} {
		if _, err := parseFlags(args, e, io.Discard); err == nil {
			t.Errorf("%q accepted", args)
		}
	}
	if _, err := parseFlags([]string{"--enable-capacity"}, env(nil), io.Discard); err == nil {
		t.Error("--enable-capacity without $NAMESPACE accepted")
	}
	if _, err := parseFlags([]string{"--enable-capacity", "--capacity-ownerref-level=-1"}, env(map[string]string{"NAMESPACE": "ns"}), io.Discard); err != nil {
		t.Errorf("no owner needs no $POD_NAME: %v", err)
	}
}

func TestCapabilities(t *testing.T) {
	modes := []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce, corev1.ReadOnlyMany, corev1.ReadWriteMany, corev1.ReadWriteOncePod}
	caps, err := capabilities(modes, false, "xfs", []string{"noatime"}, true)
	if err != nil {
		t.Fatal(err)
	}
	want := []csi.VolumeCapability_AccessMode_Mode{
		csi.VolumeCapability_AccessMode_SINGLE_NODE_MULTI_WRITER,
		csi.VolumeCapability_AccessMode_MULTI_NODE_READER_ONLY,
		csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER,
		csi.VolumeCapability_AccessMode_SINGLE_NODE_SINGLE_WRITER,
	}
	if len(caps) != len(want) {
		t.Fatalf("%d capabilities, want %d", len(caps), len(want))
	}
	for i, c := range caps {
		if c.GetAccessMode().GetMode() != want[i] {
			t.Errorf("%s: mode %v, want %v", modes[i], c.GetAccessMode().GetMode(), want[i])
		}
		m := c.GetMount()
		if m == nil || m.GetFsType() != "xfs" || len(m.GetMountFlags()) != 1 || m.GetMountFlags()[0] != "noatime" {
			t.Errorf("%s: mount %v", modes[i], m)
		}
	}

	caps, err = capabilities([]corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce, corev1.ReadWriteOncePod}, true, "ext4", nil, false)
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range caps {
		if c.GetBlock() == nil || c.GetMount() != nil {
			t.Errorf("block claim got %v", c)
		}
		if c.GetAccessMode().GetMode() != csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER {
			t.Errorf("without SINGLE_NODE_MULTI_WRITER: mode %v", c.GetAccessMode().GetMode())
		}
	}
	if _, err := capabilities(nil, false, "", nil, true); err == nil {
		t.Error("no access modes accepted")
	}
	if _, err := capabilities([]corev1.PersistentVolumeAccessMode{"ReadSometimes"}, false, "", nil, true); err == nil {
		t.Error("unknown access mode accepted")
	}
}

func TestFSTypeOf(t *testing.T) {
	for _, tc := range []struct {
		params map[string]string
		want   string
		err    bool
	}{
		{nil, "ext4", false},
		{map[string]string{"csi.storage.k8s.io/fstype": "xfs"}, "xfs", false},
		{map[string]string{"fsType": "xfs"}, "xfs", false},
		{map[string]string{"FSTYPE": "xfs"}, "xfs", false},
		{map[string]string{"csi.storage.k8s.io/fstype": "xfs", "fsType": "ext4"}, "", true},
	} {
		got, err := fsTypeOf(tc.params, "ext4")
		if (err != nil) != tc.err || got != tc.want {
			t.Errorf("%v: %q, %v; want %q, error %v", tc.params, got, err, tc.want, tc.err)
		}
	}
}

func TestCreateParams(t *testing.T) {
	pvc := &corev1.PersistentVolumeClaim{ObjectMeta: metav1.ObjectMeta{Name: "data", Namespace: "app"}}
	class := map[string]string{
		"transport":                 "relay",
		"fsType":                    "ext4",
		"csi.storage.k8s.io/fstype": "xfs",
		"csi.storage.k8s.io/provisioner-secret-name": "s",
	}
	got := createParams(class, pvc, "pvc-1", true)
	want := map[string]string{
		"transport": "relay", "fsType": "ext4",
		"csi.storage.k8s.io/pvc/name": "data", "csi.storage.k8s.io/pvc/namespace": "app", "csi.storage.k8s.io/pv/name": "pvc-1",
	}
	if len(got) != len(want) {
		t.Fatalf("got %v, want %v", got, want)
	}
	for k, v := range want {
		if got[k] != v {
			t.Errorf("%s = %q, want %q", k, got[k], v)
		}
	}
	if got := createParams(class, pvc, "pvc-1", false); len(got) != 2 {
		t.Errorf("without extra metadata: %v", got)
	}
}

func TestNodeSegment(t *testing.T) {
	node := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "n1", Labels: map[string]string{
		"topology.mpnbd.io/storage-network": "a", "zone": "z1", "other": "x",
	}}}
	cn := &storagev1.CSINode{ObjectMeta: metav1.ObjectMeta{Name: "n1"}, Spec: storagev1.CSINodeSpec{Drivers: []storagev1.CSINodeDriver{
		{Name: "other.driver", NodeID: "n1", TopologyKeys: []string{"other"}},
		{Name: testDriver, NodeID: "n1", TopologyKeys: []string{"topology.mpnbd.io/storage-network", "zone"}},
	}}}
	seg, err := nodeSegment(node, cn, testDriver)
	if err != nil {
		t.Fatal(err)
	}
	if len(seg) != 2 || seg["topology.mpnbd.io/storage-network"] != "a" || seg["zone"] != "z1" {
		t.Errorf("segment %v", seg)
	}
	req := requirement(seg)
	if len(req.GetRequisite()) != 1 || len(req.GetPreferred()) != 1 || req.GetPreferred()[0].GetSegments()["zone"] != "z1" {
		t.Errorf("requirement %v", req)
	}

	if _, err := nodeSegment(node, cn, "missing.driver"); !errors.Is(err, errNoTopology) {
		t.Errorf("driver not on the node: %v", err)
	}
	delete(node.Labels, "zone")
	if _, err := nodeSegment(node, cn, testDriver); err == nil || errors.Is(err, errNoTopology) {
		t.Errorf("missing label: %v", err)
	}
}

func TestSegmentsRequirement(t *testing.T) {
	if segmentsRequirement(nil) != nil {
		t.Error("no segments: want no requirement")
	}
	req := segmentsRequirement([]map[string]string{{"k": "b"}, {"k": "a"}, {"k": "b"}, {}})
	if len(req.GetRequisite()) != 2 || req.GetRequisite()[0].GetSegments()["k"] != "a" || req.GetRequisite()[1].GetSegments()["k"] != "b" {
		t.Errorf("requirement %v", req)
	}
	segs := allowedSegments([]corev1.TopologySelectorTerm{{MatchLabelExpressions: []corev1.TopologySelectorLabelRequirement{
		{Key: "zone", Values: []string{"z1", "z2"}}, {Key: "net", Values: []string{"a"}},
	}}})
	if len(segs) != 2 || segs[0]["net"] != "a" || segs[1]["zone"] != "z2" {
		t.Errorf("allowed segments %v", segs)
	}
}

func TestBuildPV(t *testing.T) {
	retain := corev1.PersistentVolumeReclaimRetain
	class := &storagev1.StorageClass{ObjectMeta: metav1.ObjectMeta{Name: "mpnbd"}, ReclaimPolicy: &retain, MountOptions: []string{"noatime"}}
	fs := corev1.PersistentVolumeFilesystem
	pvc := &corev1.PersistentVolumeClaim{Spec: corev1.PersistentVolumeClaimSpec{
		AccessModes: []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce}, VolumeMode: &fs,
	}}
	vol := &csi.Volume{
		VolumeId:      "vol-1",
		CapacityBytes: 2 << 30,
		VolumeContext: map[string]string{"transport": "relay"},
		AccessibleTopology: []*csi.Topology{
			{Segments: map[string]string{"zone": "z1", "net": "a"}},
			{Segments: map[string]string{"zone": "z2"}},
		},
	}
	pv := buildPV(pvSpec{name: "pvc-u1", driver: testDriver, identity: "id", class: class, pvc: pvc, fsType: "xfs", requested: 1 << 30}, vol)
	if pv.Name != "pvc-u1" || pv.Spec.StorageClassName != "mpnbd" || pv.Spec.PersistentVolumeReclaimPolicy != retain {
		t.Errorf("meta/class: %+v", pv)
	}
	if q := pv.Spec.Capacity[corev1.ResourceStorage]; q.Value() != 2<<30 {
		t.Errorf("capacity %s, want the response's 2Gi", q.String())
	}
	src := pv.Spec.CSI
	if src == nil || src.Driver != testDriver || src.VolumeHandle != "vol-1" || src.FSType != "xfs" ||
		src.VolumeAttributes["transport"] != "relay" || src.VolumeAttributes[attrIdentity] != "id" {
		t.Errorf("csi source %+v", src)
	}
	if len(pv.Spec.AccessModes) != 1 || pv.Spec.AccessModes[0] != corev1.ReadWriteOnce || *pv.Spec.VolumeMode != fs ||
		len(pv.Spec.MountOptions) != 1 {
		t.Errorf("modes/options: %+v", pv.Spec)
	}
	terms := pv.Spec.NodeAffinity.Required.NodeSelectorTerms
	if len(terms) != 2 || len(terms[0].MatchExpressions) != 2 || terms[0].MatchExpressions[0].Key != "net" ||
		terms[1].MatchExpressions[0].Values[0] != "z2" || terms[0].MatchExpressions[0].Operator != corev1.NodeSelectorOpIn {
		t.Errorf("node affinity %+v", terms)
	}

	// Block, no topology, no reported capacity, default reclaim policy.
	block := corev1.PersistentVolumeBlock
	pvc.Spec.VolumeMode = &block
	pv = buildPV(pvSpec{name: "pvc-u2", driver: testDriver, class: &storagev1.StorageClass{}, pvc: pvc, fsType: "ext4", requested: 1 << 30},
		&csi.Volume{VolumeId: "vol-2"})
	if pv.Spec.CSI.FSType != "" || *pv.Spec.VolumeMode != block || pv.Spec.NodeAffinity != nil ||
		pv.Spec.PersistentVolumeReclaimPolicy != corev1.PersistentVolumeReclaimDelete {
		t.Errorf("block PV %+v", pv.Spec)
	}
	if q := pv.Spec.Capacity[corev1.ResourceStorage]; q.Cmp(resource.MustParse("1Gi")) != 0 {
		t.Errorf("capacity %s, want the requested 1Gi", q.String())
	}
}

func TestCreateState(t *testing.T) {
	for _, tc := range []struct {
		code     codes.Code
		selected bool
		want     controller.ProvisioningState
	}{
		{codes.ResourceExhausted, true, controller.ProvisioningReschedule},
		{codes.ResourceExhausted, false, controller.ProvisioningFinished},
		{codes.DeadlineExceeded, false, controller.ProvisioningInBackground},
		{codes.Aborted, true, controller.ProvisioningInBackground},
		{codes.InvalidArgument, true, controller.ProvisioningFinished},
	} {
		if got := createState(status.Error(tc.code, "x"), tc.selected); got != tc.want {
			t.Errorf("%v selected=%v: %v, want %v", tc.code, tc.selected, got, tc.want)
		}
	}
}

func TestParseGates(t *testing.T) {
	g, err := parseGates(" Topology=true ")
	if err != nil || !g["Topology"] {
		t.Errorf("%v %v", g, err)
	}
	g, err = parseGates("")
	if err != nil || g["Topology"] {
		t.Errorf("default: %v %v", g, err)
	}
	if _, err := parseGates("Topology=true,CSIVolumeGroupSnapshot=true"); err == nil || !strings.Contains(err.Error(), "CSIVolumeGroupSnapshot") {
		t.Errorf("unknown gate: %v", err)
	}
}
