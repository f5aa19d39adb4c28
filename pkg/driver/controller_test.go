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
	"errors"
	"log/slog"
	"maps"
	"math"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/client/fake"
	"sigs.k8s.io/controller-runtime/pkg/client/interceptor"
	"sigs.k8s.io/controller-runtime/pkg/controller/controllerutil"

	"github.com/mpnbd/mpnbd/api/v1alpha1"
	"github.com/mpnbd/mpnbd/pkg/access"
)

const (
	testNamespace = "mpnbd-system"
	testPort      = 10809
	gib           = int64(1) << 30
)

var testExportAddrs = []string{"192.0.2.1", "192.0.2.2"}

// simAgent stands in for the storage agent: it puts each volume's spec in
// effect (phase Available, capacity = spec size, observedGeneration =
// generation), fails the volumes it is told to fail, ignores the ones it
// is told to hold, and removes the finalizer of deleted volumes, noting
// whether they asked for their data to be deleted.
type simAgent struct {
	c    client.Client
	mu   sync.Mutex
	fail map[string]string // volume ID -> gRPC code name for its next generation
	hold map[string]bool   // volume IDs left alone
	// released: volume ID -> whether it carried DeleteDataAnnotation
	// when its finalizer was removed.
	released map[string]bool
}

func startAgent(t *testing.T, c client.Client) *simAgent {
	t.Helper()
	a := &simAgent{c: c, fail: map[string]string{}, hold: map[string]bool{}, released: map[string]bool{}}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		tick := time.NewTicker(5 * time.Millisecond)
		defer tick.Stop()
		for {
			a.step(ctx)
			select {
			case <-ctx.Done():
				return
			case <-tick.C:
			}
		}
	}()
	t.Cleanup(func() { cancel(); <-done })
	return a
}

func (a *simAgent) setFail(id, code string) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if code == "" {
		delete(a.fail, id)
	} else {
		a.fail[id] = code
	}
}

func (a *simAgent) setHold(id string, hold bool) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.hold[id] = hold
}

// releasedWithData reports whether the agent released volume id, and
// whether it had been asked to delete its data then.
func (a *simAgent) releasedWithData(id string) (withData, released bool) {
	a.mu.Lock()
	defer a.mu.Unlock()
	withData, released = a.released[id]
	return withData, released
}

func (a *simAgent) step(ctx context.Context) {
	a.stepSnapshots(ctx)
	var list v1alpha1.NBDVolumeList
	if err := a.c.List(ctx, &list); err != nil {
		return
	}
	for i := range list.Items {
		v := &list.Items[i]
		a.mu.Lock()
		hold, code := a.hold[v.Name], a.fail[v.Name]
		a.mu.Unlock()
		switch {
		case hold:
		case v.DeletionTimestamp != nil:
			// Recorded before the update: the object goes with it, and
			// a DeleteVolume that sees it gone may return at once.
			if controllerutil.RemoveFinalizer(v, v1alpha1.Finalizer) {
				a.mu.Lock()
				a.released[v.Name] = v.DeletesData()
				a.mu.Unlock()
				if a.c.Update(ctx, v) != nil {
					a.mu.Lock()
					delete(a.released, v.Name)
					a.mu.Unlock()
				}
			}
		case code != "" && v.Status.ObservedGeneration != v.Generation && v.Status.Phase == v1alpha1.VolumeAvailable:
			// An existing volume that cannot grow keeps serving its
			// size, with the failure in its status.
			v.Status.Code, v.Status.Message = code, "simulated failure"
			v.Status.ObservedGeneration = v.Generation
			_ = a.c.Status().Update(ctx, v)
		case code != "" && v.Status.ObservedGeneration != v.Generation:
			if v.Status.Phase == v1alpha1.VolumeFailed && v.Status.Code == code {
				continue
			}
			v.Status.Phase, v.Status.Code, v.Status.Message = v1alpha1.VolumeFailed, code, "simulated failure"
			_ = a.c.Status().Update(ctx, v)
		case v.Status.Phase != v1alpha1.VolumeAvailable || v.Status.ObservedGeneration != v.Generation:
			v.Status = v1alpha1.NBDVolumeStatus{
				Phase:              v1alpha1.VolumeAvailable,
				CapacityBytes:      v.Spec.SizeBytes,
				Export:             &v1alpha1.Export{Name: v.Name, Port: testPort, Addresses: testExportAddrs},
				ObservedGeneration: v.Generation,
				// The nodes' entries, which the real agent's merge
				// patches leave alone.
				Attachments: v.Status.Attachments,
			}
			_ = a.c.Status().Update(ctx, v)
		}
	}
}

// stepSnapshots takes each snapshot (size: its source's), fails the ones
// it is told to, and removes the finalizer of deleted ones.
func (a *simAgent) stepSnapshots(ctx context.Context) {
	var list v1alpha1.NBDSnapshotList
	if err := a.c.List(ctx, &list); err != nil {
		return
	}
	for i := range list.Items {
		s := &list.Items[i]
		a.mu.Lock()
		hold, code := a.hold[s.Name], a.fail[s.Name]
		a.mu.Unlock()
		switch {
		case hold:
		case s.DeletionTimestamp != nil:
			if controllerutil.RemoveFinalizer(s, v1alpha1.SnapshotFinalizer) {
				_ = a.c.Update(ctx, s)
			}
		case s.Status.ReadyToUse || s.Status.Code != "":
		case code != "":
			s.Status.Code, s.Status.Message = code, "simulated failure"
			_ = a.c.Status().Update(ctx, s)
		default:
			var v v1alpha1.NBDVolume
			if err := a.c.Get(ctx, client.ObjectKey{Name: s.Spec.SourceVolume}, &v); err != nil {
				continue
			}
			now := metav1.Now()
			s.Status = v1alpha1.NBDSnapshotStatus{ReadyToUse: true, SizeBytes: v.Spec.SizeBytes, UsedBytes: 4096, Method: "copy", CreationTime: &now}
			_ = a.c.Status().Update(ctx, s)
		}
	}
}

func testScheme(t *testing.T) *runtime.Scheme {
	t.Helper()
	s := runtime.NewScheme()
	if err := clientgoscheme.AddToScheme(s); err != nil {
		t.Fatal(err)
	}
	if err := v1alpha1.AddToScheme(s); err != nil {
		t.Fatal(err)
	}
	return s
}

// newFakeClient returns a fake client that, like the API server, sets
// generation 1 on create and bumps it on every spec change of an
// NBDVolume.
func newFakeClient(t *testing.T) client.Client {
	return fake.NewClientBuilder().
		WithScheme(testScheme(t)).
		WithStatusSubresource(&v1alpha1.NBDVolume{}, &v1alpha1.NBDStorageNode{}, &v1alpha1.NBDSnapshot{}).
		WithInterceptorFuncs(interceptor.Funcs{
			Create: func(ctx context.Context, cl client.WithWatch, obj client.Object, opts ...client.CreateOption) error {
				if v, ok := obj.(*v1alpha1.NBDVolume); ok {
					v.Generation = 1
				}
				return cl.Create(ctx, obj, opts...)
			},
			Update: func(ctx context.Context, cl client.WithWatch, obj client.Object, opts ...client.UpdateOption) error {
				if v, ok := obj.(*v1alpha1.NBDVolume); ok {
					var old v1alpha1.NBDVolume
					if err := cl.Get(ctx, client.ObjectKeyFromObject(v), &old); err == nil {
						v.Generation = old.Generation
						if !equality.Semantic.DeepEqual(old.Spec, v.Spec) {
							v.Generation++
						}
					}
				}
				return cl.Update(ctx, obj, opts...)
			},
		}).
		Build()
}

func newTestController(t *testing.T, c client.Client, mods ...func(*ControllerConfig)) *Controller {
	t.Helper()
	cfg := ControllerConfig{
		Client:       c,
		Namespace:    testNamespace,
		Logger:       slog.New(slog.NewTextHandler(t.Output(), &slog.HandlerOptions{Level: slog.LevelDebug})),
		WaitTimeout:  20 * time.Second,
		PollInterval: 5 * time.Millisecond,
	}
	for _, m := range mods {
		m(&cfg)
	}
	ctl, err := NewController(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return ctl
}

// putStorageNode creates an NBDStorageNode and sets its status.
func putStorageNode(t *testing.T, c client.Client, name string, avail int64, topo, labels map[string]string, heartbeat time.Time) {
	t.Helper()
	ctx := context.Background()
	st := v1alpha1.NBDStorageNodeStatus{
		CapacityBytes:  avail * 2,
		AvailableBytes: avail,
		Addresses:      []string{"198.51.100.1"},
		Port:           testPort,
		Topology:       topo,
		Heartbeat:      metav1.NewTime(heartbeat),
	}
	n := &v1alpha1.NBDStorageNode{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: labels}}
	if err := c.Create(ctx, n); err != nil {
		t.Fatal(err)
	}
	n.Status = st
	if err := c.Status().Update(ctx, n); err != nil {
		t.Fatal(err)
	}
}

// nodeToken is the token of the test node name, whose hash its Node
// announces.
func nodeToken(name string) string { return access.TokenHash(name)[:32] }

// putNode creates a Kubernetes Node with storage addresses (if any) and
// its token's hash, as its node plugin announces them.
func putNode(t *testing.T, c client.Client, name string, addrs string) {
	t.Helper()
	n := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name}}
	n.Annotations = map[string]string{access.AnnotationTokenSHA256: access.TokenHash(nodeToken(name))}
	if addrs != "" {
		n.Annotations[access.AnnotationStorageAddresses] = addrs
	}
	if err := c.Create(context.Background(), n); err != nil {
		t.Fatal(err)
	}
}

func fsCap(m csi.VolumeCapability_AccessMode_Mode) *csi.VolumeCapability {
	return &csi.VolumeCapability{
		AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: m},
	}
}

func rawCap(m csi.VolumeCapability_AccessMode_Mode) *csi.VolumeCapability {
	return &csi.VolumeCapability{
		AccessType: &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: m},
	}
}

// rwo is in node_test.go.
const (
	rox = csi.VolumeCapability_AccessMode_MULTI_NODE_READER_ONLY
	rwx = csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER
)

func createReq(name string, required int64, params map[string]string, caps ...*csi.VolumeCapability) *csi.CreateVolumeRequest {
	if len(caps) == 0 {
		caps = []*csi.VolumeCapability{fsCap(rwo)}
	}
	r := &csi.CreateVolumeRequest{Name: name, VolumeCapabilities: caps, Parameters: params}
	if required > 0 {
		r.CapacityRange = &csi.CapacityRange{RequiredBytes: required}
	}
	return r
}

func wantStatus(t *testing.T, err error, code codes.Code, substrs ...string) {
	t.Helper()
	if got := status.Code(err); got != code {
		t.Fatalf("got %v (code %s), want code %s", err, got, code)
	}
	for _, s := range substrs {
		if !strings.Contains(status.Convert(err).Message(), s) {
			t.Fatalf("error %q does not mention %q", status.Convert(err).Message(), s)
		}
	}
}

func getVolume(t *testing.T, c client.Client, id string) *v1alpha1.NBDVolume {
	t.Helper()
	var v v1alpha1.NBDVolume
	if err := c.Get(context.Background(), client.ObjectKey{Name: id}, &v); err != nil {
		t.Fatalf("NBDVolume %s: %v", id, err)
	}
	return &v
}

func volumeGone(t *testing.T, c client.Client, id string) bool {
	t.Helper()
	var v v1alpha1.NBDVolume
	err := c.Get(context.Background(), client.ObjectKey{Name: id}, &v)
	if err != nil && !apierrors.IsNotFound(err) {
		t.Fatal(err)
	}
	return apierrors.IsNotFound(err)
}

func getSecret(t *testing.T, c client.Client, id, node string) (*corev1.Secret, bool) {
	t.Helper()
	var s corev1.Secret
	err := c.Get(context.Background(), client.ObjectKey{Namespace: testNamespace, Name: access.SecretName(id, node)}, &s)
	if apierrors.IsNotFound(err) {
		return nil, false
	}
	if err != nil {
		t.Fatal(err)
	}
	return &s, true
}

// setup is a controller on a fake client with a running simulated agent,
// two fresh storage nodes (big: 100 GiB in zone a, small: 10 GiB in zone
// b, labelled tier=fast) and two Kubernetes nodes.
func setup(t *testing.T, mods ...func(*ControllerConfig)) (*Controller, client.Client, *simAgent) {
	t.Helper()
	c := newFakeClient(t)
	now := time.Now()
	putStorageNode(t, c, "big", 100*gib, map[string]string{"zone": "a"}, nil, now)
	putStorageNode(t, c, "small", 10*gib, map[string]string{"zone": "b"}, map[string]string{"tier": "fast"}, now)
	putNode(t, c, "worker-1", "10.0.0.1,10.0.1.1")
	putNode(t, c, "worker-2", "10.0.0.2")
	return newTestController(t, c, mods...), c, startAgent(t, c)
}

func TestNewControllerConfig(t *testing.T) {
	c := newFakeClient(t)
	for _, cfg := range []ControllerConfig{
		{Namespace: "x"},
		{Client: c},
		{Client: c, Namespace: "x", WaitTimeout: -1},
	} {
		if _, err := NewController(cfg); status.Code(toStatus(err)) != codes.InvalidArgument {
			t.Errorf("NewController(%+v) = %v, want InvalidArgument", cfg, err)
		}
	}
	ctl, err := NewController(ControllerConfig{Client: c, Namespace: "x"})
	if err != nil {
		t.Fatal(err)
	}
	if ctl.cfg.WaitTimeout != DefaultWaitTimeout || ctl.cfg.StaleAfter != DefaultStaleAfter ||
		ctl.cfg.DefaultSizeBytes != DefaultVolumeSize || ctl.cfg.PollInterval != DefaultPollInterval {
		t.Errorf("defaults not applied: %+v", ctl.cfg)
	}
}

func TestControllerGetCapabilities(t *testing.T) {
	ctl := newTestController(t, newFakeClient(t))
	resp, err := ctl.ControllerGetCapabilities(context.Background(), &csi.ControllerGetCapabilitiesRequest{})
	if err != nil {
		t.Fatal(err)
	}
	var got []csi.ControllerServiceCapability_RPC_Type
	for _, c := range resp.GetCapabilities() {
		got = append(got, c.GetRpc().GetType())
	}
	want := []csi.ControllerServiceCapability_RPC_Type{
		csi.ControllerServiceCapability_RPC_CREATE_DELETE_VOLUME,
		csi.ControllerServiceCapability_RPC_PUBLISH_UNPUBLISH_VOLUME,
		csi.ControllerServiceCapability_RPC_LIST_VOLUMES,
		csi.ControllerServiceCapability_RPC_LIST_VOLUMES_PUBLISHED_NODES,
		csi.ControllerServiceCapability_RPC_GET_CAPACITY,
		csi.ControllerServiceCapability_RPC_EXPAND_VOLUME,
		csi.ControllerServiceCapability_RPC_PUBLISH_READONLY,
		csi.ControllerServiceCapability_RPC_SINGLE_NODE_MULTI_WRITER,
		csi.ControllerServiceCapability_RPC_CREATE_DELETE_SNAPSHOT,
		csi.ControllerServiceCapability_RPC_LIST_SNAPSHOTS,
		csi.ControllerServiceCapability_RPC_CLONE_VOLUME,
	}
	if !slices.Equal(got, want) {
		t.Errorf("capabilities %v, want %v", got, want)
	}
}

func TestCreateVolumeInvalid(t *testing.T) {
	ctl, c, _ := setup(t)
	badMode := fsCap(csi.VolumeCapability_AccessMode_UNKNOWN)
	noType := &csi.VolumeCapability{AccessMode: &csi.VolumeCapability_AccessMode{Mode: rwo}}
	withSource := createReq("src", 0, nil)
	withSource.VolumeContentSource = &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Volume{
		Volume: &csi.VolumeContentSource_VolumeSource{VolumeId: "other"}}}
	fromSnapshot := createReq("src", 0, nil)
	fromSnapshot.VolumeContentSource = &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Snapshot{
		Snapshot: &csi.VolumeContentSource_SnapshotSource{SnapshotId: "no-such-snapshot"}}}
	emptySource := createReq("src", 0, nil)
	emptySource.VolumeContentSource = &csi.VolumeContentSource{}
	for _, tc := range []struct {
		name string
		req  *csi.CreateVolumeRequest
		code codes.Code
		msg  string
	}{
		{"no name", createReq("", 0, nil), codes.InvalidArgument, "name"},
		{"no capabilities", &csi.CreateVolumeRequest{Name: "v"}, codes.InvalidArgument, "volume_capabilities"},
		{"unknown mode", createReq("v", 0, nil, badMode), codes.InvalidArgument, "access mode"},
		{"no access type", createReq("v", 0, nil, noType), codes.InvalidArgument, "access type"},
		{"mount rwx", createReq("v", 0, nil, fsCap(rwx)), codes.InvalidArgument, "block"},
		{"mixed", createReq("v", 0, nil, fsCap(rwo), rawCap(rwo)), codes.InvalidArgument, "mix"},
		{"source volume missing", withSource, codes.NotFound, "volume other"},
		{"source snapshot missing", fromSnapshot, codes.NotFound, "snapshot no-such-snapshot"},
		{"empty content source", emptySource, codes.InvalidArgument, "neither"},
		{"bad transport", createReq("v", 0, map[string]string{"transport": "warp"}), codes.InvalidArgument, "transport"},
		{"unknown key", createReq("v", 0, map[string]string{"colour": "blue"}), codes.InvalidArgument, "colour"},
		{"required over limit", &csi.CreateVolumeRequest{Name: "v", VolumeCapabilities: []*csi.VolumeCapability{fsCap(rwo)},
			CapacityRange: &csi.CapacityRange{RequiredBytes: 2 * gib, LimitBytes: gib}}, codes.InvalidArgument, "limit"},
		{"negative", &csi.CreateVolumeRequest{Name: "v", VolumeCapabilities: []*csi.VolumeCapability{fsCap(rwo)},
			CapacityRange: &csi.CapacityRange{RequiredBytes: -1}}, codes.InvalidArgument, "negative"},
		{"no aligned size in range", &csi.CreateVolumeRequest{Name: "v", VolumeCapabilities: []*csi.VolumeCapability{fsCap(rwo)},
			CapacityRange: &csi.CapacityRange{RequiredBytes: 1, LimitBytes: 100}}, codes.OutOfRange, "4096"},
		{"unknown storage node", createReq("v", 0, map[string]string{"storageNode": "nowhere"}), codes.InvalidArgument, "nowhere"},
		{"selector matches none", createReq("v", 0, map[string]string{"storageNodeSelector": "tier=slow"}), codes.ResourceExhausted, "match"},
		{"too big", createReq("v", 200*gib, nil), codes.ResourceExhausted, "available"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := ctl.CreateVolume(context.Background(), tc.req)
			wantStatus(t, err, tc.code, tc.msg)
		})
	}
	var list v1alpha1.NBDVolumeList
	if err := c.List(context.Background(), &list); err != nil {
		t.Fatal(err)
	}
	if len(list.Items) != 0 {
		t.Errorf("failed calls left %d NBDVolumes", len(list.Items))
	}
}

func TestCreateVolume(t *testing.T) {
	ctl, c, _ := setup(t)
	ctx := context.Background()
	// ext4: an xfs volume would be raised to 300 MiB (controller_size_test.go).
	params := map[string]string{"fsType": "ext4", "transport": "relay", "csi.storage.k8s.io/pvc/name": "data", "csi.storage.k8s.io/pvc/namespace": "apps"}
	resp, err := ctl.CreateVolume(ctx, createReq("pvc-1", 5000, params))
	if err != nil {
		t.Fatal(err)
	}
	vol := resp.GetVolume()
	if vol.GetVolumeId() != "pvc-1" || vol.GetCapacityBytes() != 8192 {
		t.Errorf("volume %s of %d bytes, want pvc-1 of 8192", vol.GetVolumeId(), vol.GetCapacityBytes())
	}
	// The class's parameters, and the claim for the node's metrics.
	wantCtx := map[string]string{"fsType": "ext4", "transport": "relay", VolumeContextPVCName: "data", VolumeContextPVCNamespace: "apps"}
	if !maps.Equal(vol.GetVolumeContext(), wantCtx) {
		t.Errorf("volume context %v, want %v", vol.GetVolumeContext(), wantCtx)
	}
	wantCtx = map[string]string{"fsType": "ext4", "transport": "relay"}
	if len(vol.GetAccessibleTopology()) != 1 || !maps.Equal(vol.GetAccessibleTopology()[0].GetSegments(), map[string]string{"zone": "a"}) {
		t.Errorf("accessible topology %v, want zone=a", vol.GetAccessibleTopology())
	}
	v := getVolume(t, c, "pvc-1")
	if v.Spec.StorageNode != "big" || v.Spec.SizeBytes != 8192 || v.Spec.AccessType != v1alpha1.AccessFilesystem ||
		v.Spec.MultiNode || !maps.Equal(v.Spec.Parameters, wantCtx) {
		t.Errorf("spec %+v", v.Spec)
	}
	if v.Annotations[access.AnnotationCSIName] != "pvc-1" || !slices.Contains(v.Finalizers, v1alpha1.Finalizer) ||
		v.Annotations[VolumeContextPVCName] != "data" || v.Annotations[VolumeContextPVCNamespace] != "apps" {
		t.Errorf("metadata %+v", v.ObjectMeta)
	}

	// Idempotent: the same request again, and one with a compatible range.
	again, err := ctl.CreateVolume(ctx, createReq("pvc-1", 5000, params))
	if err != nil || again.GetVolume().GetVolumeId() != "pvc-1" || again.GetVolume().GetCapacityBytes() != 8192 {
		t.Fatalf("repeated CreateVolume = %v, %v", again, err)
	}
	// Different capacity, parameters, access type or access mode.
	for name, req := range map[string]*csi.CreateVolumeRequest{
		"size":   createReq("pvc-1", 2*gib, params),
		"params": createReq("pvc-1", 5000, map[string]string{"fsType": "xfs"}),
		"block":  createReq("pvc-1", 5000, params, rawCap(rwo)),
		"multi":  createReq("pvc-1", 5000, params, fsCap(rox)),
	} {
		_, err := ctl.CreateVolume(ctx, req)
		if status.Code(err) != codes.AlreadyExists {
			t.Errorf("%s: CreateVolume = %v, want AlreadyExists", name, err)
		}
	}

	// A name that is no DNS subdomain gets a hashed ID; block and
	// multi-node are recorded; the default size applies.
	resp, err = ctl.CreateVolume(ctx, createReq("Volume_With_Caps", 0, nil, rawCap(rwx)))
	if err != nil {
		t.Fatal(err)
	}
	id := resp.GetVolume().GetVolumeId()
	if id != VolumeIDForName("Volume_With_Caps") || !strings.HasPrefix(id, "vol-") || len(id) != 36 {
		t.Errorf("volume ID %q", id)
	}
	v = getVolume(t, c, id)
	if v.Spec.AccessType != v1alpha1.AccessBlock || !v.Spec.MultiNode || v.Spec.SizeBytes != gib {
		t.Errorf("spec %+v", v.Spec)
	}
	// No claim named: none in the context.
	if len(resp.GetVolume().GetVolumeContext()) != 0 || v.Annotations[VolumeContextPVCName] != "" {
		t.Errorf("a volume made for no claim: context %v, annotations %v", resp.GetVolume().GetVolumeContext(), v.Annotations)
	}
	if resp.GetVolume().GetCapacityBytes() != gib {
		t.Errorf("capacity %d, want default %d", resp.GetVolume().GetCapacityBytes(), gib)
	}
}

func TestCreateVolumeSizes(t *testing.T) {
	for _, tc := range []struct {
		req, lim, unit, want int64
	}{
		{0, 0, 4096, gib},
		{1, 0, 4096, 4096},
		{4096, 4096, 4096, 4096},
		{4097, 0, 512, 4608},
		{0, 10000, 4096, 8192},
		{0, 4096, 4096, 4096},
	} {
		got, err := volumeSize(&csi.CapacityRange{RequiredBytes: tc.req, LimitBytes: tc.lim}, gib, tc.unit)
		if err != nil || got != tc.want {
			t.Errorf("volumeSize(%d, %d, unit %d) = %d, %v; want %d", tc.req, tc.lim, tc.unit, got, err, tc.want)
		}
	}
	if _, err := volumeSize(&csi.CapacityRange{RequiredBytes: math.MaxInt64 - 10}, gib, 4096); status.Code(toStatus(err)) != codes.OutOfRange {
		t.Errorf("huge size: %v, want OutOfRange", err)
	}
}

func TestCreateVolumePlacement(t *testing.T) {
	ctx := context.Background()
	ctl, c, _ := setup(t)
	putStorageNode(t, c, "stale", 500*gib, map[string]string{"zone": "c"}, nil, time.Now().Add(-time.Hour))
	place := func(name string, req *csi.CreateVolumeRequest) string {
		t.Helper()
		req.Name = name
		resp, err := ctl.CreateVolume(ctx, req)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		return getVolume(t, c, resp.GetVolume().GetVolumeId()).Spec.StorageNode
	}
	topo := func(zone string) *csi.Topology { return &csi.Topology{Segments: map[string]string{"zone": zone}} }

	if got := place("most-room", createReq("", gib, nil)); got != "big" {
		t.Errorf("picked %s, want the node with the most room (big)", got)
	}
	if got := place("named", createReq("", gib, map[string]string{"storageNode": "small"})); got != "small" {
		t.Errorf("picked %s, want small (storageNode)", got)
	}
	if got := place("by-label", createReq("", gib, map[string]string{"storageNodeSelector": "tier=fast"})); got != "small" {
		t.Errorf("picked %s, want small (label selector)", got)
	}
	if got := place("by-topology-key", createReq("", gib, map[string]string{"storageNodeSelector": "zone=b"})); got != "small" {
		t.Errorf("picked %s, want small (topology selector)", got)
	}
	req := createReq("", gib, nil)
	req.AccessibilityRequirements = &csi.TopologyRequirement{Requisite: []*csi.Topology{topo("b"), topo("c")}}
	if got := place("requisite", req); got != "small" {
		t.Errorf("picked %s, want small (requisite zone b; zone c is stale)", got)
	}
	req = createReq("", gib, nil)
	req.AccessibilityRequirements = &csi.TopologyRequirement{
		Requisite: []*csi.Topology{topo("a"), topo("b")},
		Preferred: []*csi.Topology{topo("b"), topo("a")},
	}
	if got := place("preferred", req); got != "small" {
		t.Errorf("picked %s, want small (preferred zone b)", got)
	}
	req = createReq("", 20*gib, nil)
	req.AccessibilityRequirements = &csi.TopologyRequirement{Preferred: []*csi.Topology{topo("b")}}
	if got := place("preferred-full", req); got != "big" {
		t.Errorf("picked %s, want big (preferred zone b has no room)", got)
	}

	for name, tc := range map[string]struct {
		req  *csi.CreateVolumeRequest
		code codes.Code
	}{
		"only stale": {createReq("x1", gib, map[string]string{"storageNode": "stale"}), codes.Unavailable},
		"no topology": {func() *csi.CreateVolumeRequest {
			r := createReq("x2", gib, nil)
			r.AccessibilityRequirements = &csi.TopologyRequirement{Requisite: []*csi.Topology{topo("z")}}
			return r
		}(), codes.ResourceExhausted},
		"no room in zone b": {func() *csi.CreateVolumeRequest {
			r := createReq("x3", 20*gib, nil)
			r.AccessibilityRequirements = &csi.TopologyRequirement{Requisite: []*csi.Topology{topo("b")}}
			return r
		}(), codes.ResourceExhausted},
	} {
		_, err := ctl.CreateVolume(ctx, tc.req)
		if status.Code(err) != tc.code {
			t.Errorf("%s: %v, want %s", name, err, tc.code)
		}
	}

	// No storage node at all.
	empty := newTestController(t, newFakeClient(t))
	_, err := empty.CreateVolume(ctx, createReq("v", gib, nil))
	wantStatus(t, err, codes.Unavailable, "NBDStorageNode")
}

func TestCreateVolumeAgentFailure(t *testing.T) {
	ctx := context.Background()
	ctl, c, agent := setup(t)
	agent.setFail("doomed", "ResourceExhausted")
	_, err := ctl.CreateVolume(ctx, createReq("doomed", gib, nil))
	wantStatus(t, err, codes.ResourceExhausted, "simulated failure")
	// The failed volume is deleted (the agent drops the finalizer), so a
	// retry starts afresh.
	deadline := time.Now().Add(20 * time.Second)
	for !volumeGone(t, c, "doomed") {
		if time.Now().After(deadline) {
			t.Fatal("the failed NBDVolume was not deleted")
		}
		time.Sleep(5 * time.Millisecond)
	}
	agent.setFail("doomed", "")
	if _, err := ctl.CreateVolume(ctx, createReq("doomed", gib, nil)); err != nil {
		t.Fatalf("retry after the failure: %v", err)
	}

	// An unknown code becomes Internal.
	agent.setFail("odd", "NoSuchCode")
	_, err = ctl.CreateVolume(ctx, createReq("odd", gib, nil))
	wantStatus(t, err, codes.Internal, "simulated failure")
}

func TestCreateVolumeTimeout(t *testing.T) {
	ctx := context.Background()
	ctl, c, agent := setup(t, func(cfg *ControllerConfig) { cfg.WaitTimeout = 200 * time.Millisecond })
	agent.setHold("slow", true)
	_, err := ctl.CreateVolume(ctx, createReq("slow", gib, nil))
	wantStatus(t, err, codes.DeadlineExceeded, "slow")
	if getVolume(t, c, "slow").Spec.StorageNode == "" {
		t.Fatal("no storage node recorded")
	}
	// The next call picks up the same object.
	agent.setHold("slow", false)
	ctl.cfg.WaitTimeout = 20 * time.Second
	resp, err := ctl.CreateVolume(ctx, createReq("slow", gib, nil))
	if err != nil || resp.GetVolume().GetVolumeId() != "slow" {
		t.Fatalf("second CreateVolume = %v, %v", resp, err)
	}
}

func TestControllerContention(t *testing.T) {
	ctx := context.Background()
	ctl, _, _ := setup(t)
	if _, err := ctl.CreateVolume(ctx, createReq("busy", gib, nil)); err != nil {
		t.Fatal(err)
	}
	unlock, ok := ctl.lock("busy")
	if !ok {
		t.Fatal("lock is held")
	}
	defer unlock()
	calls := map[string]func() error{
		"CreateVolume": func() error { _, err := ctl.CreateVolume(ctx, createReq("busy", gib, nil)); return err },
		"DeleteVolume": func() error {
			_, err := ctl.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: "busy"})
			return err
		},
		"ControllerPublishVolume": func() error {
			_, err := ctl.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: "busy", NodeId: "worker-1", VolumeCapability: fsCap(rwo)})
			return err
		},
		"ControllerUnpublishVolume": func() error {
			_, err := ctl.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: "busy", NodeId: "worker-1"})
			return err
		},
		"ControllerExpandVolume": func() error {
			_, err := ctl.ControllerExpandVolume(ctx, &csi.ControllerExpandVolumeRequest{VolumeId: "busy", CapacityRange: &csi.CapacityRange{RequiredBytes: 2 * gib}})
			return err
		},
	}
	for name, call := range calls {
		if err := call(); status.Code(err) != codes.Aborted {
			t.Errorf("%s while the volume is locked: %v, want Aborted", name, err)
		}
	}
}

func publishReq(id, node string, vc *csi.VolumeCapability, ro bool) *csi.ControllerPublishVolumeRequest {
	return &csi.ControllerPublishVolumeRequest{VolumeId: id, NodeId: node, VolumeCapability: vc, Readonly: ro}
}

func TestPublishInvalid(t *testing.T) {
	ctx := context.Background()
	ctl, _, _ := setup(t)
	if _, err := ctl.CreateVolume(ctx, createReq("fs", gib, nil)); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name string
		req  *csi.ControllerPublishVolumeRequest
		code codes.Code
		msg  string
	}{
		{"no volume", publishReq("", "worker-1", fsCap(rwo), false), codes.InvalidArgument, "volume_id"},
		{"no node", publishReq("fs", "", fsCap(rwo), false), codes.InvalidArgument, "node_id"},
		{"no capability", publishReq("fs", "worker-1", nil, false), codes.InvalidArgument, "volume_capability"},
		{"unknown volume", publishReq("ghost", "worker-1", fsCap(rwo), false), codes.NotFound, "ghost"},
		{"invalid volume ID", publishReq("Not/A/Name", "worker-1", fsCap(rwo), false), codes.NotFound, ""},
		{"unknown node", publishReq("fs", "fake-node", fsCap(rwo), false), codes.NotFound, "fake-node"},
		{"block on filesystem", publishReq("fs", "worker-1", rawCap(rwo), false), codes.InvalidArgument, "block"},
		{"multi-node on single-node", publishReq("fs", "worker-1", fsCap(rox), false), codes.InvalidArgument, "multi-node"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := ctl.ControllerPublishVolume(ctx, tc.req)
			wantStatus(t, err, tc.code, tc.msg)
		})
	}
}

func TestPublishUnpublish(t *testing.T) {
	ctx := context.Background()
	ctl, c, _ := setup(t)
	if _, err := ctl.CreateVolume(ctx, createReq("fs", gib, nil)); err != nil {
		t.Fatal(err)
	}
	resp, err := ctl.ControllerPublishVolume(ctx, publishReq("fs", "worker-1", fsCap(rwo), false))
	if err != nil {
		t.Fatal(err)
	}
	pc := resp.GetPublishContext()
	if _, ok := getSecret(t, c, "fs", "worker-1"); ok {
		t.Error("a publication Secret was made: the node has a token of its own")
	}
	v := getVolume(t, c, "fs")
	if pc[PublishContextExport] != "fs" || pc[PublishContextAddresses] != "192.0.2.1:10809,192.0.2.2:10809" {
		t.Errorf("publish context %v", pc)
	}
	// The publication carries the hash the node announced and the
	// addresses its token is good from.
	wantPub := []v1alpha1.Publication{{NodeID: "worker-1", TokenSHA256: access.TokenHash(nodeToken("worker-1")), Addresses: []string{"10.0.0.1", "10.0.1.1"}, Epoch: 1}}
	if !equality.Semantic.DeepEqual(v.Spec.Publications, wantPub) || v.Status.ObservedGeneration != v.Generation {
		t.Errorf("publications %+v (generation %d, observed %d)", v.Spec.Publications, v.Generation, v.Status.ObservedGeneration)
	}
	// The node plugin can use what it got.
	if spec, err := parseAttachSpec("fs", pc, nil, "", nodeToken("worker-1")); err != nil || spec.Target.Export != access.NodeExport("fs", nodeToken("worker-1"))+"@"+pc[PublishContextEpoch] {
		t.Errorf("node side: %+v, %v", spec.Target, err)
	}

	// Idempotent, and the same token.
	again, err := ctl.ControllerPublishVolume(ctx, publishReq("fs", "worker-1", fsCap(rwo), false))
	if err != nil || !maps.Equal(again.GetPublishContext(), pc) {
		t.Fatalf("repeated publish = %v, %v", again, err)
	}
	// Read-only mismatch.
	_, err = ctl.ControllerPublishVolume(ctx, publishReq("fs", "worker-1", fsCap(rwo), true))
	wantStatus(t, err, codes.AlreadyExists, "readonly")
	// The fence: a single-node volume stays on its node.
	_, err = ctl.ControllerPublishVolume(ctx, publishReq("fs", "worker-2", fsCap(rwo), false))
	wantStatus(t, err, codes.FailedPrecondition, "worker-1")
	if _, ok := getSecret(t, c, "fs", "worker-2"); ok {
		t.Error("the refused publication left a Secret")
	}
	// Published volumes are not deleted.
	_, err = ctl.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: "fs"})
	wantStatus(t, err, codes.FailedPrecondition, "worker-1")

	// Unpublish, twice.
	for i := range 2 {
		if _, err := ctl.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: "fs", NodeId: "worker-1"}); err != nil {
			t.Fatalf("unpublish %d: %v", i, err)
		}
	}
	if v := getVolume(t, c, "fs"); len(v.Spec.Publications) != 0 {
		t.Errorf("publications left: %+v", v.Spec.Publications)
	}
	if _, ok := getSecret(t, c, "fs", "worker-1"); ok {
		t.Error("Secret left after unpublish")
	}
	// A node that announced no address or no token hash is refused: its
	// token would be good from anywhere, or there is none to check.
	putNode(t, c, "worker-3", "")
	_, err = ctl.ControllerPublishVolume(ctx, publishReq("fs", "worker-3", fsCap(rwo), false))
	wantStatus(t, err, codes.Unavailable, "worker-3", access.AnnotationStorageAddresses)
	if err := c.Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "worker-4",
		Annotations: map[string]string{access.AnnotationStorageAddresses: "10.0.0.4"}}}); err != nil {
		t.Fatal(err)
	}
	_, err = ctl.ControllerPublishVolume(ctx, publishReq("fs", "worker-4", fsCap(rwo), false))
	wantStatus(t, err, codes.Unavailable, "worker-4", access.AnnotationTokenSHA256)
	// Now the other node may have it, with its own token.
	if _, err = ctl.ControllerPublishVolume(ctx, publishReq("fs", "worker-2", fsCap(rwo), false)); err != nil {
		t.Fatal(err)
	}
	if v := getVolume(t, c, "fs"); len(v.Spec.Publications) != 1 || v.Spec.Publications[0].TokenSHA256 != access.TokenHash(nodeToken("worker-2")) {
		t.Errorf("publication to worker-2: %+v", v.Spec.Publications)
	}

	// Unpublish of unknown volumes and nodes succeeds.
	for _, r := range []*csi.ControllerUnpublishVolumeRequest{
		{VolumeId: "ghost", NodeId: "worker-1"},
		{VolumeId: "fs", NodeId: "worker-9"},
		{VolumeId: "Not_An_ID"},
	} {
		if _, err := ctl.ControllerUnpublishVolume(ctx, r); err != nil {
			t.Errorf("unpublish %v: %v", r, err)
		}
	}
	_, err = ctl.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{NodeId: "worker-1"})
	wantStatus(t, err, codes.InvalidArgument, "volume_id")
}

// TestPublishContextHoldsNoToken: Kubernetes keeps the publish context
// in the VolumeAttachment's status, cluster-scoped and readable by many.
// It holds no token for any volume, with encryption or without: the
// export's name alone, to which the node adds its own token. No Secret of
// the driver's namespace shows in it either.
func TestPublishContextHoldsNoToken(t *testing.T) {
	ctx := context.Background()
	ctl, c, _ := setup(t)
	for id, params := range map[string]map[string]string{
		"plain": nil, "pref": {ParamEncryption: "preferred"}, "enc": {ParamEncryption: "required"},
	} {
		if _, err := ctl.CreateVolume(ctx, createReq(id, gib, params)); err != nil {
			t.Fatal(err)
		}
		resp, err := ctl.ControllerPublishVolume(ctx, publishReq(id, "worker-1", fsCap(rwo), false))
		if err != nil {
			t.Fatal(err)
		}
		pc := resp.GetPublishContext()
		if export := pc[PublishContextExport]; export != id {
			t.Errorf("%s: the publish context names export %q, want %q alone", id, export, id)
		}
		var secrets corev1.SecretList
		if err := c.List(ctx, &secrets, client.InNamespace(testNamespace)); err != nil {
			t.Fatal(err)
		}
		for k, v := range pc {
			if strings.Contains(v, nodeToken("worker-1")) {
				t.Errorf("%s: publish context %s holds the node's token", id, k)
			}
			for _, s := range secrets.Items {
				for sk, sv := range s.Data {
					if len(sv) > 0 && strings.Contains(v, string(sv)) {
						t.Errorf("%s: publish context %s holds Secret %s's %s", id, k, s.Name, sk)
					}
				}
			}
		}
		spec, err := parseAttachSpec(id, pc, params, "/state/identity", nodeToken("worker-1"))
		if err != nil {
			t.Fatal(err)
		}
		want := access.NodeExport(id, nodeToken("worker-1")) + "@" + pc[PublishContextEpoch]
		if id == "enc" {
			want = id + "@" + pc[PublishContextEpoch]
		}
		if spec.Target.Export != want {
			t.Errorf("%s: the node opens %q, want %q", id, spec.Target.Export, want)
		}
	}
}

// TestPublishEpochs: every publication of a volume gets an epoch greater
// than those of the ones before it (to any node), which the node presents
// in the export name it opens; a repeated publish keeps it.
func TestPublishEpochs(t *testing.T) {
	ctx := context.Background()
	ctl, _, _ := setup(t)
	if _, err := ctl.CreateVolume(ctx, createReq("fs", gib, nil)); err != nil {
		t.Fatal(err)
	}
	epochOf := func() (int64, map[string]string) {
		t.Helper()
		resp, err := ctl.ControllerPublishVolume(ctx, publishReq("fs", "worker-1", fsCap(rwo), false))
		if err != nil {
			t.Fatal(err)
		}
		e, err := strconv.ParseInt(resp.GetPublishContext()[PublishContextEpoch], 10, 64)
		if err != nil || e <= 0 {
			t.Fatalf("publish context %v: no epoch", resp.GetPublishContext())
		}
		return e, resp.GetPublishContext()
	}
	first, _ := epochOf()
	if again, _ := epochOf(); again != first {
		t.Errorf("a repeated publish changed the epoch from %d to %d", first, again)
	}
	if _, err := ctl.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: "fs", NodeId: "worker-1"}); err != nil {
		t.Fatal(err)
	}
	second, pc := epochOf()
	if second <= first {
		t.Errorf("published again with epoch %d, after %d", second, first)
	}
	spec, err := parseAttachSpec("fs", pc, nil, "", nodeToken("worker-1"))
	if want := access.ExportName("fs", nodeToken("worker-1"), second); err != nil || spec.Target.Export != want {
		t.Errorf("the node opens %q, %v; want %q", spec.Target.Export, err, want)
	}
}

// TestTokenHashes: publications made by earlier controllers, with a
// per-(volume, node) Secret, keep working: made before they carried their
// token's hash, they get it from BackfillTokenHashes, or when the volume
// is published again; one whose Secret is gone gets a new token, Secret
// and hash from the next publish.
func TestTokenHashes(t *testing.T) {
	ctx := context.Background()
	ctl, c, _ := setup(t)
	tokens := map[string]string{}
	for _, id := range []string{"old", "lost", "again"} {
		if _, err := ctl.CreateVolume(ctx, createReq(id, gib, nil)); err != nil {
			t.Fatal(err)
		}
		// As an older controller left it: a Secret, no hash.
		tok, err := ctl.ensureSecret(ctx, getVolume(t, c, id), "worker-1")
		if err != nil {
			t.Fatal(err)
		}
		tokens[id] = tok
		v := getVolume(t, c, id)
		v.Spec.Publications = []v1alpha1.Publication{{NodeID: "worker-1", SecretRef: access.SecretName(id, "worker-1"), Addresses: []string{"10.0.0.1"}}}
		if err := c.Update(ctx, v); err != nil {
			t.Fatal(err)
		}
	}
	if err := c.Delete(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: testNamespace, Name: access.SecretName("lost", "worker-1")}}); err != nil {
		t.Fatal(err)
	}
	hashOf := func(id string) string { return getVolume(t, c, id).Spec.Publications[0].TokenSHA256 }

	// Published again: the hash of the token it hands out.
	resp, err := ctl.ControllerPublishVolume(ctx, publishReq("again", "worker-1", fsCap(rwo), false))
	if err != nil {
		t.Fatal(err)
	}
	if got := hashOf("again"); got != access.TokenHash(tokens["again"]) || resp.GetPublishContext()[PublishContextExport] != access.NodeExport("again", tokens["again"]) {
		t.Errorf("published again: hash %q, context %v; want the hash of the same token", got, resp.GetPublishContext())
	}

	n, err := ctl.BackfillTokenHashes(ctx)
	if err != nil || n != 1 {
		t.Fatalf("backfill: %d, %v; want 1 publication filled in", n, err)
	}
	if got := hashOf("old"); got != access.TokenHash(tokens["old"]) {
		t.Errorf("old: hash %q, want that of its Secret's token", got)
	}
	if got := hashOf("lost"); got != "" {
		t.Errorf("lost: hash %q without a Secret to take it from", got)
	}
	if n, err := ctl.BackfillTokenHashes(ctx); err != nil || n != 0 {
		t.Errorf("second backfill: %d, %v; want nothing left to fill", n, err)
	}

	// The Secret gone: a new token, whose hash the publication gets.
	resp, err = ctl.ControllerPublishVolume(ctx, publishReq("lost", "worker-1", fsCap(rwo), false))
	if err != nil {
		t.Fatal(err)
	}
	s, ok := getSecret(t, c, "lost", "worker-1")
	if !ok {
		t.Fatal("lost: publishing again made no Secret")
	}
	tok := string(s.Data[access.SecretKeyToken])
	if tok == tokens["lost"] || hashOf("lost") != access.TokenHash(tok) || resp.GetPublishContext()[PublishContextExport] != access.NodeExport("lost", tok) {
		t.Errorf("lost, published again: token renewed %t, hash %q, context %v", tok != tokens["lost"], hashOf("lost"), resp.GetPublishContext())
	}
}

func TestPublishMultiNode(t *testing.T) {
	ctx := context.Background()
	ctl, c, _ := setup(t)
	if _, err := ctl.CreateVolume(ctx, createReq("shared", gib, nil, rawCap(rwx), rawCap(rox))); err != nil {
		t.Fatal(err)
	}
	if _, err := ctl.ControllerPublishVolume(ctx, publishReq("shared", "worker-1", rawCap(rwx), false)); err != nil {
		t.Fatal(err)
	}
	if _, err := ctl.ControllerPublishVolume(ctx, publishReq("shared", "worker-2", rawCap(rox), false)); err != nil {
		t.Fatal(err)
	}
	v := getVolume(t, c, "shared")
	if len(v.Spec.Publications) != 2 || v.Spec.Publications[0].ReadOnly || !v.Spec.Publications[1].ReadOnly {
		t.Errorf("publications %+v, want worker-1 read-write and worker-2 read-only", v.Spec.Publications)
	}
	// Unpublish from every node at once.
	if _, err := ctl.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: "shared"}); err != nil {
		t.Fatal(err)
	}
	if v := getVolume(t, c, "shared"); len(v.Spec.Publications) != 0 {
		t.Errorf("publications left: %+v", v.Spec.Publications)
	}
	for _, n := range []string{"worker-1", "worker-2"} {
		if _, ok := getSecret(t, c, "shared", n); ok {
			t.Errorf("Secret of %s left", n)
		}
	}
}

func TestPublishUnavailable(t *testing.T) {
	ctx := context.Background()
	ctl, c, agent := setup(t)
	if _, err := ctl.CreateVolume(ctx, createReq("sick", gib, nil)); err != nil {
		t.Fatal(err)
	}
	agent.setHold("sick", true)
	v := getVolume(t, c, "sick")
	v.Status.Phase = v1alpha1.VolumePending
	if err := c.Status().Update(ctx, v); err != nil {
		t.Fatal(err)
	}
	_, err := ctl.ControllerPublishVolume(ctx, publishReq("sick", "worker-1", fsCap(rwo), false))
	wantStatus(t, err, codes.Unavailable, "Pending")
}

func TestPublishTimeoutThenRetry(t *testing.T) {
	ctx := context.Background()
	ctl, c, agent := setup(t)
	if _, err := ctl.CreateVolume(ctx, createReq("lag", gib, nil)); err != nil {
		t.Fatal(err)
	}
	agent.setHold("lag", true)
	ctl.cfg.WaitTimeout = 200 * time.Millisecond
	_, err := ctl.ControllerPublishVolume(ctx, publishReq("lag", "worker-1", fsCap(rwo), false))
	wantStatus(t, err, codes.DeadlineExceeded, "grant")
	if v := getVolume(t, c, "lag"); len(v.Spec.Publications) != 1 {
		t.Fatalf("publications after the timed-out publish: %+v", v.Spec.Publications)
	}
	agent.setHold("lag", false)
	ctl.cfg.WaitTimeout = 20 * time.Second
	resp, err := ctl.ControllerPublishVolume(ctx, publishReq("lag", "worker-1", fsCap(rwo), false))
	if err != nil {
		t.Fatal(err)
	}
	if got := resp.GetPublishContext()[PublishContextExport]; got != "lag" {
		t.Errorf("retry got export %q, want %q", got, "lag")
	}
}

func TestDeleteVolume(t *testing.T) {
	ctx := context.Background()
	ctl, c, agent := setup(t)
	_, err := ctl.DeleteVolume(ctx, &csi.DeleteVolumeRequest{})
	wantStatus(t, err, codes.InvalidArgument, "volume_id")
	for _, id := range []string{"ghost", "fake-vol-id", "Not/An/ID"} {
		if _, err := ctl.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: id}); err != nil {
			t.Errorf("DeleteVolume(%q) = %v, want success", id, err)
		}
	}
	if _, err := ctl.CreateVolume(ctx, createReq("gone", gib, nil)); err != nil {
		t.Fatal(err)
	}
	// A Secret left by an interrupted publish goes with the volume.
	if _, err := ctl.ensureSecret(ctx, getVolume(t, c, "gone"), "worker-1"); err != nil {
		t.Fatal(err)
	}
	// The agent holds the finalizer: the call times out, the object stays.
	agent.setHold("gone", true)
	ctl.cfg.WaitTimeout = 200 * time.Millisecond
	_, err = ctl.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: "gone"})
	wantStatus(t, err, codes.DeadlineExceeded, "backing store")
	if v := getVolume(t, c, "gone"); v.DeletionTimestamp == nil {
		t.Error("the volume is not being deleted")
	}
	if _, ok := getSecret(t, c, "gone", "worker-1"); ok {
		t.Error("the volume's Secret survived")
	}
	// CreateVolume of the same name must wait.
	_, err = ctl.CreateVolume(ctx, createReq("gone", gib, nil))
	wantStatus(t, err, codes.Aborted, "deleted")
	agent.setHold("gone", false)
	ctl.cfg.WaitTimeout = 20 * time.Second
	for i := range 2 {
		if _, err := ctl.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: "gone"}); err != nil {
			t.Fatalf("delete %d: %v", i, err)
		}
		if !volumeGone(t, c, "gone") {
			t.Fatal("volume still there after DeleteVolume succeeded")
		}
	}
	if withData, released := agent.releasedWithData("gone"); !released || !withData {
		t.Errorf("agent released the volume %t, asked to delete its data %t; want both", released, withData)
	}
}

// TestDeleteVolumeMarksData: DeleteVolume sets DeleteDataAnnotation before
// it deletes the object (retrying a conflict), and on an object someone
// deleted by hand, so that the agent deletes the data of both.
func TestDeleteVolumeMarksData(t *testing.T) {
	ctx := context.Background()
	_, c, agent := setup(t)
	var mu sync.Mutex
	var deletes []string // volume ID: annotation value when Delete was called
	conflicts := 1       // the first marking update of "conflicted" fails so
	ic := interceptor.NewClient(c.(client.WithWatch), interceptor.Funcs{
		Delete: func(ctx context.Context, cl client.WithWatch, obj client.Object, opts ...client.DeleteOption) error {
			if _, ok := obj.(*v1alpha1.NBDVolume); ok {
				var cur v1alpha1.NBDVolume
				if err := cl.Get(ctx, client.ObjectKeyFromObject(obj), &cur); err == nil {
					mu.Lock()
					deletes = append(deletes, cur.Name+": "+cur.Annotations[v1alpha1.DeleteDataAnnotation])
					mu.Unlock()
				}
			}
			return cl.Delete(ctx, obj, opts...)
		},
		Update: func(ctx context.Context, cl client.WithWatch, obj client.Object, opts ...client.UpdateOption) error {
			mu.Lock()
			marking := obj.GetAnnotations()[v1alpha1.DeleteDataAnnotation] != ""
			conflict := marking && obj.GetName() == "conflicted" && conflicts > 0
			if conflict {
				conflicts--
			}
			mu.Unlock()
			if conflict {
				return apierrors.NewConflict(v1alpha1.GroupVersion.WithResource("nbdvolumes").GroupResource(), obj.GetName(), errors.New("simulated"))
			}
			return cl.Update(ctx, obj, opts...)
		},
	})
	ctl := newTestController(t, ic)
	short := newTestController(t, ic, func(cfg *ControllerConfig) { cfg.WaitTimeout = 200 * time.Millisecond })

	for _, id := range []string{"marked", "conflicted"} {
		if _, err := ctl.CreateVolume(ctx, createReq(id, gib, nil)); err != nil {
			t.Fatal(err)
		}
		if _, err := ctl.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: id}); err != nil {
			t.Fatalf("DeleteVolume(%s): %v", id, err)
		}
		if withData, released := agent.releasedWithData(id); !released || !withData {
			t.Errorf("%s: agent released it %t, asked to delete its data %t; want both", id, released, withData)
		}
	}
	want := []string{"marked: " + v1alpha1.DeleteDataTrue, "conflicted: " + v1alpha1.DeleteDataTrue}
	mu.Lock()
	if !slices.Equal(deletes, want) || conflicts != 0 {
		t.Errorf("deletes %q (conflicts left %d), want %q", deletes, conflicts, want)
	}
	mu.Unlock()

	// Deleted by hand, held by its agent: DeleteVolume marks it, and
	// does not delete it again.
	if _, err := ctl.CreateVolume(ctx, createReq("by-hand", gib, nil)); err != nil {
		t.Fatal(err)
	}
	agent.setHold("by-hand", true)
	if err := c.Delete(ctx, getVolume(t, c, "by-hand")); err != nil {
		t.Fatal(err)
	}
	if v := getVolume(t, c, "by-hand"); v.DeletionTimestamp == nil || v.DeletesData() {
		t.Fatalf("deleted by hand: deletion %v, annotations %v", v.DeletionTimestamp, v.Annotations)
	}
	_, err := short.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: "by-hand"})
	wantStatus(t, err, codes.DeadlineExceeded, "backing store")
	if v := getVolume(t, c, "by-hand"); !v.DeletesData() {
		t.Fatalf("DeleteVolume of a volume deleted by hand left annotations %v", v.Annotations)
	}
	agent.setHold("by-hand", false)
	for i := range 2 {
		if _, err := ctl.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: "by-hand"}); err != nil {
			t.Fatalf("delete %d: %v", i, err)
		}
	}
	if withData, released := agent.releasedWithData("by-hand"); !released || !withData {
		t.Errorf("by-hand: agent released it %t, asked to delete its data %t; want both", released, withData)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(deletes) != len(want) {
		t.Errorf("DeleteVolume deleted a volume being deleted again: %q", deletes[len(want):])
	}
}

func TestValidateVolumeCapabilities(t *testing.T) {
	ctx := context.Background()
	ctl, _, _ := setup(t)
	params := map[string]string{"fsType": "xfs"}
	if _, err := ctl.CreateVolume(ctx, createReq("fs", gib, params)); err != nil {
		t.Fatal(err)
	}
	_, err := ctl.ValidateVolumeCapabilities(ctx, &csi.ValidateVolumeCapabilitiesRequest{VolumeCapabilities: []*csi.VolumeCapability{fsCap(rwo)}})
	wantStatus(t, err, codes.InvalidArgument, "volume_id")
	_, err = ctl.ValidateVolumeCapabilities(ctx, &csi.ValidateVolumeCapabilitiesRequest{VolumeId: "fs"})
	wantStatus(t, err, codes.InvalidArgument, "volume_capabilities")
	_, err = ctl.ValidateVolumeCapabilities(ctx, &csi.ValidateVolumeCapabilitiesRequest{VolumeId: "ghost", VolumeCapabilities: []*csi.VolumeCapability{fsCap(rwo)}})
	wantStatus(t, err, codes.NotFound, "ghost")

	volCtx := map[string]string{"fsType": "xfs"}
	resp, err := ctl.ValidateVolumeCapabilities(ctx, &csi.ValidateVolumeCapabilitiesRequest{
		VolumeId: "fs", VolumeCapabilities: []*csi.VolumeCapability{fsCap(rwo)}, VolumeContext: volCtx, Parameters: params,
	})
	if err != nil || resp.GetConfirmed() == nil || len(resp.GetConfirmed().GetVolumeCapabilities()) != 1 ||
		!maps.Equal(resp.GetConfirmed().GetVolumeContext(), volCtx) || !maps.Equal(resp.GetConfirmed().GetParameters(), params) {
		t.Fatalf("ValidateVolumeCapabilities = %v, %v", resp, err)
	}
	for name, r := range map[string]*csi.ValidateVolumeCapabilitiesRequest{
		"block":         {VolumeId: "fs", VolumeCapabilities: []*csi.VolumeCapability{rawCap(rwo)}},
		"multi-node":    {VolumeId: "fs", VolumeCapabilities: []*csi.VolumeCapability{fsCap(rwo), fsCap(rox)}},
		"mount rwx":     {VolumeId: "fs", VolumeCapabilities: []*csi.VolumeCapability{fsCap(rwx)}},
		"other params":  {VolumeId: "fs", VolumeCapabilities: []*csi.VolumeCapability{fsCap(rwo)}, Parameters: map[string]string{"fsType": "ext4"}},
		"invalid param": {VolumeId: "fs", VolumeCapabilities: []*csi.VolumeCapability{fsCap(rwo)}, Parameters: map[string]string{"bogus": "1"}},
	} {
		resp, err := ctl.ValidateVolumeCapabilities(ctx, r)
		if err != nil || resp.GetConfirmed() != nil || resp.GetMessage() == "" {
			t.Errorf("%s: %v, %v; want unconfirmed with a message", name, resp, err)
		}
	}
}

func TestListVolumes(t *testing.T) {
	ctx := context.Background()
	ctl, _, _ := setup(t)
	ids := []string{"e", "a", "d", "b", "c"}
	for _, id := range ids {
		if _, err := ctl.CreateVolume(ctx, createReq(id, gib, nil)); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := ctl.ControllerPublishVolume(ctx, publishReq("c", "worker-1", fsCap(rwo), false)); err != nil {
		t.Fatal(err)
	}
	var got []string
	tok := ""
	for pages := 0; ; pages++ {
		if pages > 5 {
			t.Fatal("pagination does not end")
		}
		resp, err := ctl.ListVolumes(ctx, &csi.ListVolumesRequest{MaxEntries: 2, StartingToken: tok})
		if err != nil {
			t.Fatal(err)
		}
		if n := len(resp.GetEntries()); n > 2 || n == 0 {
			t.Fatalf("page of %d entries", n)
		}
		for _, e := range resp.GetEntries() {
			got = append(got, e.GetVolume().GetVolumeId())
			wantNodes := []string(nil)
			if e.GetVolume().GetVolumeId() == "c" {
				wantNodes = []string{"worker-1"}
			}
			if !slices.Equal(e.GetStatus().GetPublishedNodeIds(), wantNodes) {
				t.Errorf("%s published to %v, want %v", e.GetVolume().GetVolumeId(), e.GetStatus().GetPublishedNodeIds(), wantNodes)
			}
			if e.GetVolume().GetCapacityBytes() != gib || len(e.GetVolume().GetAccessibleTopology()) != 1 {
				t.Errorf("entry %v", e.GetVolume())
			}
		}
		if tok = resp.GetNextToken(); tok == "" {
			break
		}
	}
	if !slices.Equal(got, []string{"a", "b", "c", "d", "e"}) {
		t.Errorf("listed %v", got)
	}
	all, err := ctl.ListVolumes(ctx, &csi.ListVolumesRequest{})
	if err != nil || len(all.GetEntries()) != 5 || all.GetNextToken() != "" {
		t.Fatalf("unpaged ListVolumes = %v, %v", all, err)
	}
	// A token whose volume was deleted meanwhile still works.
	resp, err := ctl.ListVolumes(ctx, &csi.ListVolumesRequest{MaxEntries: 2})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ctl.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: "c"}); status.Code(err) != codes.FailedPrecondition {
		t.Fatalf("deleting a published volume: %v", err)
	}
	if _, err := ctl.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: "c"}); err != nil {
		t.Fatal(err)
	}
	if _, err := ctl.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: "c"}); err != nil {
		t.Fatal(err)
	}
	rest, err := ctl.ListVolumes(ctx, &csi.ListVolumesRequest{StartingToken: resp.GetNextToken()})
	if err != nil {
		t.Fatal(err)
	}
	var restIDs []string
	for _, e := range rest.GetEntries() {
		restIDs = append(restIDs, e.GetVolume().GetVolumeId())
	}
	if !slices.Equal(restIDs, []string{"d", "e"}) {
		t.Errorf("after deleting the next page's first volume: %v, want [d e]", restIDs)
	}

	for _, tok := range []string{"invalid-token", "after:Bad_ID", "5"} {
		_, err := ctl.ListVolumes(ctx, &csi.ListVolumesRequest{StartingToken: tok})
		wantStatus(t, err, codes.Aborted, "starting_token")
	}
	_, err = ctl.ListVolumes(ctx, &csi.ListVolumesRequest{MaxEntries: -1})
	wantStatus(t, err, codes.InvalidArgument, "max_entries")
}

func TestGetCapacity(t *testing.T) {
	ctx := context.Background()
	ctl, c, _ := setup(t)
	putStorageNode(t, c, "stale", 500*gib, map[string]string{"zone": "a"}, nil, time.Now().Add(-time.Hour))
	for _, tc := range []struct {
		name          string
		req           *csi.GetCapacityRequest
		total, maxVol int64
	}{
		{"all", &csi.GetCapacityRequest{}, 110 * gib, 100 * gib},
		{"named", &csi.GetCapacityRequest{Parameters: map[string]string{"storageNode": "small"}}, 10 * gib, 10 * gib},
		{"selector", &csi.GetCapacityRequest{Parameters: map[string]string{"storageNodeSelector": "tier=fast"}}, 10 * gib, 10 * gib},
		{"topology", &csi.GetCapacityRequest{AccessibleTopology: &csi.Topology{Segments: map[string]string{"zone": "a"}}}, 100 * gib, 100 * gib},
		{"no match", &csi.GetCapacityRequest{AccessibleTopology: &csi.Topology{Segments: map[string]string{"zone": "z"}}}, 0, 0},
	} {
		resp, err := ctl.GetCapacity(ctx, tc.req)
		if err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		if resp.GetAvailableCapacity() != tc.total || resp.GetMaximumVolumeSize().GetValue() != tc.maxVol {
			t.Errorf("%s: capacity %d, max %d; want %d, %d", tc.name, resp.GetAvailableCapacity(),
				resp.GetMaximumVolumeSize().GetValue(), tc.total, tc.maxVol)
		}
	}
	_, err := ctl.GetCapacity(ctx, &csi.GetCapacityRequest{Parameters: map[string]string{"fsType": "zfs"}})
	wantStatus(t, err, codes.InvalidArgument, "fsType")
}

func TestControllerExpandVolume(t *testing.T) {
	ctx := context.Background()
	ctl, c, agent := setup(t)
	if _, err := ctl.CreateVolume(ctx, createReq("grow", gib, map[string]string{"blockSize": "512"})); err != nil {
		t.Fatal(err)
	}
	expand := func(req, lim int64) (*csi.ControllerExpandVolumeResponse, error) {
		return ctl.ControllerExpandVolume(ctx, &csi.ControllerExpandVolumeRequest{
			VolumeId: "grow", CapacityRange: &csi.CapacityRange{RequiredBytes: req, LimitBytes: lim}})
	}
	_, err := ctl.ControllerExpandVolume(ctx, &csi.ControllerExpandVolumeRequest{CapacityRange: &csi.CapacityRange{RequiredBytes: gib}})
	wantStatus(t, err, codes.InvalidArgument, "volume_id")
	_, err = ctl.ControllerExpandVolume(ctx, &csi.ControllerExpandVolumeRequest{VolumeId: "grow"})
	wantStatus(t, err, codes.InvalidArgument, "capacity_range")
	_, err = ctl.ControllerExpandVolume(ctx, &csi.ControllerExpandVolumeRequest{VolumeId: "ghost", CapacityRange: &csi.CapacityRange{RequiredBytes: gib}})
	wantStatus(t, err, codes.NotFound, "ghost")
	_, err = expand(2*gib+1, 2*gib+100)
	wantStatus(t, err, codes.OutOfRange, "limit")

	resp, err := expand(2*gib+1, 0)
	if err != nil {
		t.Fatal(err)
	}
	want := 2*gib + 512 // rounded up to the volume's block size
	if resp.GetCapacityBytes() != want || !resp.GetNodeExpansionRequired() {
		t.Errorf("expand = %v, want %d bytes and node expansion", resp, want)
	}
	if v := getVolume(t, c, "grow"); v.Spec.SizeBytes != want || v.Status.ObservedGeneration != v.Generation {
		t.Errorf("spec size %d (generation %d observed %d)", v.Spec.SizeBytes, v.Generation, v.Status.ObservedGeneration)
	}
	// Smaller or equal: nothing to do.
	gen := getVolume(t, c, "grow").Generation
	for _, size := range []int64{gib, want} {
		resp, err := expand(size, 0)
		if err != nil || resp.GetCapacityBytes() != want {
			t.Errorf("expand to %d = %v, %v; want %d", size, resp, err, want)
		}
	}
	if g := getVolume(t, c, "grow").Generation; g != gen {
		t.Errorf("a no-op expand changed the spec (generation %d -> %d)", gen, g)
	}
	// The agent cannot grow it: the expansion fails with its code, and
	// again when retried, but the volume stays usable at its size.
	agent.setFail("grow", "ResourceExhausted")
	_, err = expand(50*gib, 0)
	wantStatus(t, err, codes.ResourceExhausted, "simulated failure")
	_, err = expand(50*gib, 0)
	wantStatus(t, err, codes.ResourceExhausted, "simulated failure")
	if _, err := ctl.ControllerPublishVolume(ctx, publishReq("grow", "worker-1", fsCap(rwo), false)); err != nil {
		t.Fatalf("publish a volume whose expansion failed: %v", err)
	}
}

func TestCodeByName(t *testing.T) {
	for name, want := range map[string]codes.Code{
		"ResourceExhausted":  codes.ResourceExhausted,
		"RESOURCE_EXHAUSTED": codes.ResourceExhausted,
		"FailedPrecondition": codes.FailedPrecondition,
		"Internal":           codes.Internal,
	} {
		if got, ok := codeByName(name); !ok || got != want {
			t.Errorf("codeByName(%q) = %v, %t", name, got, ok)
		}
	}
	for _, name := range []string{"", "Exhausted", "99"} {
		if _, ok := codeByName(name); ok {
			t.Errorf("codeByName(%q) accepted", name)
		}
	}
}

func TestControllerAPIErrors(t *testing.T) {
	ctx := context.Background()
	gr := v1alpha1.GroupVersion.WithResource("nbdvolumes").GroupResource()
	var getErr, updateErr error
	c := fake.NewClientBuilder().
		WithScheme(testScheme(t)).
		WithStatusSubresource(&v1alpha1.NBDVolume{}, &v1alpha1.NBDStorageNode{}).
		WithObjects(&v1alpha1.NBDVolume{
			ObjectMeta: metav1.ObjectMeta{Name: "vol", Finalizers: []string{v1alpha1.Finalizer}},
			Spec:       v1alpha1.NBDVolumeSpec{SizeBytes: gib, StorageNode: "big", AccessType: v1alpha1.AccessFilesystem},
		}).
		WithInterceptorFuncs(interceptor.Funcs{
			Get: func(ctx context.Context, cl client.WithWatch, key client.ObjectKey, obj client.Object, opts ...client.GetOption) error {
				if _, ok := obj.(*v1alpha1.NBDVolume); ok && getErr != nil {
					return getErr
				}
				return cl.Get(ctx, key, obj, opts...)
			},
			Update: func(ctx context.Context, cl client.WithWatch, obj client.Object, opts ...client.UpdateOption) error {
				if updateErr != nil {
					return updateErr
				}
				return cl.Update(ctx, obj, opts...)
			},
		}).
		Build()
	ctl := newTestController(t, c)
	expand := func() error {
		_, err := ctl.ControllerExpandVolume(ctx, &csi.ControllerExpandVolumeRequest{
			VolumeId: "vol", CapacityRange: &csi.CapacityRange{RequiredBytes: 2 * gib}})
		return err
	}
	getErr = apierrors.NewServiceUnavailable("etcd is down")
	wantStatus(t, expand(), codes.Unavailable, "etcd is down")
	getErr = apierrors.NewForbidden(gr, "vol", nil)
	wantStatus(t, expand(), codes.Internal, "forbidden")
	getErr = nil
	updateErr = apierrors.NewConflict(gr, "vol", nil)
	wantStatus(t, expand(), codes.Aborted, "concurrently")
}

func TestPublishAttachLimit(t *testing.T) {
	ctx := context.Background()
	ctl, c, _ := setup(t)
	count := int32(1)
	cn := &storagev1.CSINode{
		ObjectMeta: metav1.ObjectMeta{Name: "worker-1"},
		Spec: storagev1.CSINodeSpec{Drivers: []storagev1.CSINodeDriver{
			{Name: "other.csi.example.com", NodeID: "worker-1"},
			{Name: DriverName, NodeID: "worker-1", Allocatable: &storagev1.VolumeNodeResources{Count: &count}},
		}},
	}
	if err := c.Create(ctx, cn); err != nil {
		t.Fatal(err)
	}
	for _, id := range []string{"first", "second"} {
		if _, err := ctl.CreateVolume(ctx, createReq(id, gib, nil)); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := ctl.ControllerPublishVolume(ctx, publishReq("first", "worker-1", fsCap(rwo), false)); err != nil {
		t.Fatal(err)
	}
	// Publishing the same volume again is not a new attachment.
	if _, err := ctl.ControllerPublishVolume(ctx, publishReq("first", "worker-1", fsCap(rwo), false)); err != nil {
		t.Fatalf("repeated publish at the limit: %v", err)
	}
	_, err := ctl.ControllerPublishVolume(ctx, publishReq("second", "worker-1", fsCap(rwo), false))
	wantStatus(t, err, codes.ResourceExhausted, "worker-1", "limit")
	if _, ok := getSecret(t, c, "second", "worker-1"); ok {
		t.Error("a refused publication left a Secret")
	}
	if _, err := ctl.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: "first", NodeId: "worker-1"}); err != nil {
		t.Fatal(err)
	}
	if _, err := ctl.ControllerPublishVolume(ctx, publishReq("second", "worker-1", fsCap(rwo), false)); err != nil {
		t.Fatalf("publish after making room: %v", err)
	}
}

// TestPublishEncrypted: a volume whose StorageClass requires encryption
// is published without a token: no Secret, no credential in the publish
// context (which Kubernetes keeps in the VolumeAttachment); the node opens
// it by name with its certificate, which must name the storage node the
// context gives.
func TestPublishEncrypted(t *testing.T) {
	ctx := context.Background()
	ctl, c, _ := setup(t)
	if _, err := ctl.CreateVolume(ctx, createReq("enc", gib, map[string]string{ParamEncryption: "required"})); err != nil {
		t.Fatal(err)
	}
	v := getVolume(t, c, "enc")
	if v.Spec.Encryption != v1alpha1.EncryptionRequired {
		t.Fatalf("spec.encryption %q", v.Spec.Encryption)
	}
	resp, err := ctl.ControllerPublishVolume(ctx, publishReq("enc", "worker-1", fsCap(rwo), false))
	if err != nil {
		t.Fatal(err)
	}
	pc := resp.GetPublishContext()
	if pc[PublishContextExport] != "enc" || pc[PublishContextStorageNode] != v.Spec.StorageNode || pc[PublishContextStorageNode] == "" {
		t.Errorf("publish context %v", pc)
	}
	if _, ok := getSecret(t, c, "enc", "worker-1"); ok {
		t.Error("an encrypted volume's publication made a Secret")
	}
	v = getVolume(t, c, "enc")
	if len(v.Spec.Publications) != 1 || v.Spec.Publications[0].SecretRef != "" || v.Spec.Publications[0].NodeID != "worker-1" {
		t.Errorf("publications %+v", v.Spec.Publications)
	}
	spec, err := parseAttachSpec("enc", pc, map[string]string{ParamEncryption: "required"}, "/state/identity", nodeToken("worker-1"))
	if err != nil || spec.Target.TLS == nil || spec.Target.TLS.StorageNode != v.Spec.StorageNode || spec.Target.TLS.Optional {
		t.Errorf("node side: %+v, %v", spec.Target, err)
	}
	// Preferred keeps the node's token: a transport without TLS may
	// still be used.
	if _, err := ctl.CreateVolume(ctx, createReq("pref", gib, map[string]string{ParamEncryption: "preferred"})); err != nil {
		t.Fatal(err)
	}
	resp, err = ctl.ControllerPublishVolume(ctx, publishReq("pref", "worker-1", fsCap(rwo), false))
	if err != nil {
		t.Fatal(err)
	}
	if p := getVolume(t, c, "pref").Spec.Publications; resp.GetPublishContext()[PublishContextExport] != "pref" || len(p) != 1 || p[0].TokenSHA256 != access.TokenHash(nodeToken("worker-1")) {
		t.Errorf("preferred: publish context %v, publications %+v", resp.GetPublishContext(), p)
	}
	if _, err := ctl.CreateVolume(ctx, createReq("bad", gib, map[string]string{ParamEncryption: "always"})); err == nil {
		t.Error("encryption=always accepted")
	} else {
		wantStatus(t, err, codes.InvalidArgument, "encryption")
	}
}

// TestDefaultEncryption: a class that names no encryption gets the
// controller's default (kept in the volume's parameters, which the node
// reads); one that names its own keeps it; a retry of the same request
// finds the same volume; a class whose transport cannot encrypt is refused
// under a required default with a message that says where the
// requirement comes from.
func TestDefaultEncryption(t *testing.T) {
	ctx := context.Background()
	ctl, c, _ := setup(t, func(cfg *ControllerConfig) { cfg.DefaultEncryption = v1alpha1.EncryptionRequired })
	req := createReq("dflt", gib, map[string]string{ParamFSType: "xfs"})
	resp, err := ctl.CreateVolume(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	if got := resp.GetVolume().GetVolumeContext()[ParamEncryption]; got != "required" {
		t.Errorf("volume context %v: want encryption required", resp.GetVolume().GetVolumeContext())
	}
	if v := getVolume(t, c, "dflt"); v.Spec.Encryption != v1alpha1.EncryptionRequired || v.Spec.Parameters[ParamEncryption] != "required" {
		t.Errorf("spec.encryption %q, parameters %v", v.Spec.Encryption, v.Spec.Parameters)
	}
	if _, err := ctl.CreateVolume(ctx, req); err != nil {
		t.Errorf("the same request again: %v", err)
	}
	vv, err := ctl.ValidateVolumeCapabilities(ctx, &csi.ValidateVolumeCapabilitiesRequest{
		VolumeId: "dflt", VolumeCapabilities: []*csi.VolumeCapability{fsCap(rwo)}, Parameters: req.Parameters})
	if err != nil || vv.GetConfirmed() == nil {
		t.Errorf("validate with the class's parameters: %v, %q", err, vv.GetMessage())
	}

	if _, err := ctl.CreateVolume(ctx, createReq("own", gib, map[string]string{ParamEncryption: "none"})); err != nil {
		t.Fatal(err)
	}
	if v := getVolume(t, c, "own"); v.Spec.Encryption != v1alpha1.EncryptionNone {
		t.Errorf("a class naming none: spec.encryption %q", v.Spec.Encryption)
	}
	_, err = ctl.CreateVolume(ctx, createReq("kern", gib, map[string]string{ParamTransport: "kernel"}))
	wantStatus(t, err, codes.InvalidArgument, "transport=kernel", "--default-encryption", "defaultEncryption", "required")
	if _, err := ctl.CreateVolume(ctx, createReq("kern-pref", gib, map[string]string{ParamTransport: "kernel", ParamEncryption: "preferred"})); err != nil {
		t.Errorf("a kernel class naming preferred: %v", err)
	}
	// auto: the node picks a transport that can.
	if _, err := ctl.CreateVolume(ctx, createReq("auto", gib, map[string]string{ParamTransport: "auto"})); err != nil {
		t.Errorf("an auto class: %v", err)
	}

	// Without a default, a class naming none stays unencrypted.
	ctl2, c2, _ := setup(t)
	if _, err := ctl2.CreateVolume(ctx, createReq("plain", gib, nil)); err != nil {
		t.Fatal(err)
	}
	if v := getVolume(t, c2, "plain"); v.Spec.Encryption != v1alpha1.EncryptionNone || v.Spec.Parameters[ParamEncryption] != "" {
		t.Errorf("no default: spec.encryption %q, parameters %v", v.Spec.Encryption, v.Spec.Parameters)
	}
	if _, err := NewController(ControllerConfig{Client: c2, Namespace: "x", DefaultEncryption: "always"}); status.Code(toStatus(err)) != codes.InvalidArgument {
		t.Errorf("default encryption always: %v", err)
	}
}
