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

package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/client/fake"

	"github.com/mpnbd/mpnbd/api/v1alpha1"
	"github.com/mpnbd/mpnbd/pkg/access"
	"github.com/mpnbd/mpnbd/pkg/attach"
	"github.com/mpnbd/mpnbd/pkg/driver"
)

// fakeVolume is one volume attached on a fake node plugin.
type fakeVolume struct {
	transport attach.Transport
	// addrs is how many storage addresses it was published with: the
	// subflows each connection should have.
	addrs  int
	health attach.Health
}

// fakeAttacher is a node plugin's data path with fixed healths; it also
// lists the volumes (driver.VolumeLister).
type fakeAttacher struct{ vols map[string]fakeVolume }

func (f *fakeAttacher) Attach(ctx context.Context, tr attach.Transport, t attach.Target, o attach.Options) (*attach.Attachment, error) {
	v, ok := f.vols[t.VolumeID]
	if !ok {
		return nil, fmt.Errorf("fake attacher: no volume %s", t.VolumeID)
	}
	return &attach.Attachment{VolumeID: t.VolumeID, Transport: v.transport, Device: "/dev/fake-" + t.VolumeID, MPTCP: v.health.MPTCP}, nil
}

func (f *fakeAttacher) Detach(ctx context.Context, volumeID string) error { return nil }

func (f *fakeAttacher) Resize(ctx context.Context, volumeID string, n uint64) (uint64, error) {
	return 0, errors.New("fake attacher: no resize")
}

func (f *fakeAttacher) Health(volumeID string) (attach.Transport, attach.Health, error) {
	v, ok := f.vols[volumeID]
	if !ok {
		return "", attach.Health{}, fmt.Errorf("%w: %s", attach.ErrNotAttached, volumeID)
	}
	return v.transport, v.health, nil
}

func (f *fakeAttacher) Volumes() map[string]attach.Transport {
	out := map[string]attach.Transport{}
	for id, v := range f.vols {
		out[id] = v.transport
	}
	return out
}

// dirMounter is the one effect staging a Block volume has: its staging
// directory.
type dirMounter struct{ driver.Mounter }

func (dirMounter) MakeDir(p string) error { return os.MkdirAll(p, 0o755) }

// nodePlugin serves, like the node plugin's --metrics-addr, the metrics
// of the real driver.NodeCollector over a driver.Node that staged vols,
// on 127.0.0.1. It returns the /metrics URL.
func nodePlugin(t *testing.T, name string, vols map[string]fakeVolume) string {
	t.Helper()
	return nodePluginAt(t, "127.0.0.1", name, vols)
}

// nodePluginAt is nodePlugin listening on a port of the IP address addr.
func nodePluginAt(t *testing.T, addr, name string, vols map[string]fakeVolume) string {
	t.Helper()
	att := &fakeAttacher{vols: vols}
	token, err := access.NewToken()
	if err != nil {
		t.Fatal(err)
	}
	n, err := driver.NewNode(driver.NodeConfig{NodeID: name, Attacher: att, Mounter: dirMounter{}, Logger: slog.New(slog.DiscardHandler), Token: token})
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	for id, v := range vols {
		var addrs []string
		for i := range v.addrs {
			addrs = append(addrs, fmt.Sprintf("10.0.%d.1:10809", i))
		}
		if _, err := n.NodeStageVolume(context.Background(), &csi.NodeStageVolumeRequest{
			VolumeId:          id,
			StagingTargetPath: filepath.Join(dir, id),
			VolumeCapability: &csi.VolumeCapability{
				AccessType: &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}},
				AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER},
			},
			PublishContext: map[string]string{driver.PublishContextExport: id + "-token", driver.PublishContextAddresses: strings.Join(addrs, ",")},
		}); err != nil {
			t.Fatalf("staging %s on %s: %v", id, name, err)
		}
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(driver.NewNodeCollector(n, att), collectors.NewGoCollector())
	l, err := net.Listen("tcp", net.JoinHostPort(addr, "0"))
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewUnstartedServer(promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	srv.Listener.Close()
	srv.Listener = l
	srv.Start()
	t.Cleanup(srv.Close)
	return srv.URL + "/metrics"
}

// hostAddress is an IPv4 address of this host that the API server proxies
// to (not loopback, not link-local), on an interface that is up; "" when
// there is none.
func hostAddress(t *testing.T) string {
	t.Helper()
	ifs, err := net.Interfaces()
	if err != nil {
		t.Fatal(err)
	}
	for _, ifc := range ifs {
		if ifc.Flags&net.FlagUp == 0 || ifc.Flags&net.FlagLoopback != 0 {
			continue
		}
		addrs, err := ifc.Addrs()
		if err != nil {
			continue
		}
		for _, a := range addrs {
			ipn, ok := a.(*net.IPNet)
			if ok && ipn.IP.To4() != nil && ipn.IP.IsGlobalUnicast() {
				return ipn.IP.String()
			}
		}
	}
	return ""
}

// nodePluginNamespace is the namespace of the fixtures' node plugin pods.
const nodePluginNamespace = "mpnbd-system"

// newNodePluginPod is a node plugin pod of the chart on node, with the
// container port metrics when port is not 0, in phase with IP ip (as
// its status, to be written separately on a real API server).
func newNodePluginPod(name, node string, port int32, phase corev1.PodPhase, ip string) *corev1.Pod {
	c := corev1.Container{Name: "node", Image: "mpnbd:test", Ports: []corev1.ContainerPort{{Name: "healthz", ContainerPort: 9809}}}
	if port != 0 {
		c.Ports = append(c.Ports, corev1.ContainerPort{Name: "metrics", ContainerPort: port})
	}
	p := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: nodePluginNamespace, Name: name, Labels: map[string]string{
			"app.kubernetes.io/name": "mpnbd", "app.kubernetes.io/component": "node", "app.kubernetes.io/instance": "mpnbd",
		}},
		Spec: corev1.PodSpec{NodeName: node, HostNetwork: true, Containers: []corev1.Container{
			c, {Name: "liveness-probe", Image: "livenessprobe:test"},
		}},
		Status: corev1.PodStatus{Phase: phase},
	}
	if ip != "" {
		p.Status.PodIP, p.Status.PodIPs, p.Status.HostIP = ip, []corev1.PodIP{{IP: ip}}, ip
		p.Status.HostIPs = []corev1.HostIP{{IP: ip}}
	}
	return p
}

// downURL is the URL of a node plugin that is gone.
func downURL(t *testing.T) string {
	t.Helper()
	srv := httptest.NewServer(http.NotFoundHandler())
	u := srv.URL + "/metrics"
	srv.Close()
	return u
}

func testScheme(t testing.TB) *runtime.Scheme {
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

// fakeAPI is a fake API server holding objs; Events can be listed by
// involvedObject.name, as on a real one.
func fakeAPI(t testing.TB, objs ...client.Object) *fake.ClientBuilder {
	return fake.NewClientBuilder().WithScheme(testScheme(t)).WithObjects(objs...).
		WithIndex(&corev1.Event{}, "involvedObject.name", func(o client.Object) []string {
			return []string{o.(*corev1.Event).InvolvedObject.Name}
		})
}

// testTime is when the fixtures' conditions and Events happened.
var testTime = time.Date(2025, 3, 4, 5, 6, 7, 0, time.UTC)

// newVolume is an NBDVolume on storage-1 with four storage addresses,
// published to nodes.
func newVolume(name string, phase v1alpha1.VolumePhase, nodes ...string) *v1alpha1.NBDVolume {
	v := &v1alpha1.NBDVolume{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec: v1alpha1.NBDVolumeSpec{
			SizeBytes: 10 << 30, StorageNode: "storage-1", AccessType: v1alpha1.AccessBlock,
			Parameters: map[string]string{driver.ParamTransport: "auto"},
		},
		Status: v1alpha1.NBDVolumeStatus{
			Phase: phase, CapacityBytes: 10 << 30,
			Export: &v1alpha1.Export{Name: name, Port: 10809, Addresses: []string{"10.0.0.1", "10.0.1.1", "10.0.2.1", "10.0.3.1"}},
			Conditions: []metav1.Condition{{Type: "Ready", Status: metav1.ConditionTrue, Reason: "Available",
				Message: "exported", LastTransitionTime: metav1.NewTime(testTime)}},
		},
	}
	for _, n := range nodes {
		v.Spec.Publications = append(v.Spec.Publications, v1alpha1.Publication{NodeID: n, SecretRef: name + "-" + n})
	}
	return v
}

// newPV is the PV of volume id, bound to claim NAMESPACE/NAME.
func newPV(id, claim string) *corev1.PersistentVolume {
	ns, name, _ := strings.Cut(claim, "/")
	return &corev1.PersistentVolume{
		ObjectMeta: metav1.ObjectMeta{Name: id},
		Spec: corev1.PersistentVolumeSpec{
			Capacity:    corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("10Gi")},
			AccessModes: []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
			PersistentVolumeSource: corev1.PersistentVolumeSource{
				CSI: &corev1.CSIPersistentVolumeSource{Driver: driver.DriverName, VolumeHandle: id},
			},
			ClaimRef: &corev1.ObjectReference{Kind: "PersistentVolumeClaim", Namespace: ns, Name: name},
		},
	}
}

// newPVC is claim NAMESPACE/NAME bound to PV pv.
func newPVC(claim, pv string) *corev1.PersistentVolumeClaim {
	ns, name, _ := strings.Cut(claim, "/")
	return &corev1.PersistentVolumeClaim{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name},
		Spec: corev1.PersistentVolumeClaimSpec{
			AccessModes: []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
			Resources:   corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("10Gi")}},
			VolumeName:  pv,
		},
	}
}

// newNode is a Node whose InternalIP is ip ("" for none).
func newNode(name, ip string) *corev1.Node {
	n := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name}}
	if ip != "" {
		n.Status.Addresses = []corev1.NodeAddress{{Type: corev1.NodeHostName, Address: name}, {Type: corev1.NodeInternalIP, Address: ip}}
	}
	return n
}

// newClaimEvent is a Warning Event the node plugin on node recorded on
// claim NAMESPACE/NAME.
func newClaimEvent(claim, node, reason, msg string, at time.Time) *corev1.Event {
	ns, name, _ := strings.Cut(claim, "/")
	return &corev1.Event{
		ObjectMeta:     metav1.ObjectMeta{Namespace: ns, Name: name + "." + strings.ToLower(reason)},
		InvolvedObject: corev1.ObjectReference{APIVersion: "v1", Kind: "PersistentVolumeClaim", Namespace: ns, Name: name},
		Reason:         reason,
		Message:        msg,
		Type:           corev1.EventTypeWarning,
		Source:         corev1.EventSource{Component: nodePluginComponent, Host: node},
		FirstTimestamp: metav1.NewTime(at),
		LastTimestamp:  metav1.NewTime(at),
		Count:          1,
	}
}
