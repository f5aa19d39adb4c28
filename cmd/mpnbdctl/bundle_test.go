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
	"archive/tar"
	"bytes"
	"compress/gzip"
	"context"
	"encoding/base64"
	"fmt"
	"io"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/mpnbd/mpnbd/api/v1alpha1"
	"github.com/mpnbd/mpnbd/internal/testenv/apiserver"
	"github.com/mpnbd/mpnbd/pkg/attach"
	"github.com/mpnbd/mpnbd/pkg/buildinfo"
	"github.com/mpnbd/mpnbd/pkg/driver"
)

// TestTailWriter: a log longer than the cap keeps its last bytes, from
// its first whole line, after a line saying how much was left out; a
// shorter one is kept whole, however it was written.
func TestTailWriter(t *testing.T) {
	var log strings.Builder
	for i := range 100 {
		fmt.Fprintf(&log, "line %03d\n", i) // 9 bytes a line
	}
	for _, tc := range []struct {
		max    int
		chunks []int // the sizes of the writes
		want   string
	}{
		{1000, []int{900}, log.String()},
		{900, []int{1, 8, 500, 391}, log.String()},
		// 95 bytes kept: 5 of line 089's, then 090 to 099.
		{95, []int{900}, "[mpnbdctl: the first 810 bytes of this log left out: the last 90 bytes kept (--log-bytes)]\n" + log.String()[810:]},
		{95, []int{7, 100, 3, 790}, "[mpnbdctl: the first 810 bytes of this log left out: the last 90 bytes kept (--log-bytes)]\n" + log.String()[810:]},
		{95, []int{1, 1, 898}, "[mpnbdctl: the first 810 bytes of this log left out: the last 90 bytes kept (--log-bytes)]\n" + log.String()[810:]},
		// Exactly one line kept, cut at its start.
		{9, []int{900}, "[mpnbdctl: the first 891 bytes of this log left out: the last 9 bytes kept (--log-bytes)]\nline 099\n"},
	} {
		w := newTailWriter(tc.max)
		s := log.String()
		for _, n := range tc.chunks {
			if k, err := w.Write([]byte(s[:n])); k != n || err != nil {
				t.Fatalf("write: %d, %v", k, err)
			}
			s = s[n:]
		}
		if got := string(w.text()); got != tc.want {
			t.Errorf("max %d, writes %v: kept\n%q\nwant\n%q", tc.max, tc.chunks, got, tc.want)
		}
	}
	// A line longer than what is kept: its end, not nothing.
	w := newTailWriter(4)
	_, _ = w.Write([]byte("abcdefgh"))
	if got := string(w.text()); !strings.HasSuffix(got, "]\nefgh") {
		t.Errorf("a long line: %q", got)
	}
}

// readBundle reads a support bundle: its files by path under its one
// directory, and the whole tar uncompressed.
func readBundle(t *testing.T, r io.Reader) (files map[string]string, dir string, raw []byte) {
	t.Helper()
	gz, err := gzip.NewReader(r)
	if err != nil {
		t.Fatalf("not gzip: %v", err)
	}
	raw, err = io.ReadAll(gz)
	if err != nil {
		t.Fatal(err)
	}
	files = map[string]string{}
	tr := tar.NewReader(bytes.NewReader(raw))
	for {
		h, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatalf("not a tar: %v", err)
		}
		d, name, ok := strings.Cut(h.Name, "/")
		if !ok || (dir != "" && d != dir) {
			t.Fatalf("file %s not under the bundle's one directory %s", h.Name, dir)
		}
		dir = d
		b, err := io.ReadAll(tr)
		if err != nil {
			t.Fatal(err)
		}
		if _, dup := files[name]; dup {
			t.Errorf("%s twice", name)
		}
		files[name] = string(b)
	}
	return files, dir, raw
}

// TestSupportBundleAgainstAPIServer runs support-bundle against a real
// API server holding the driver's objects and another provisioner's, a
// Secret, the driver's pods (no kubelet: their logs cannot be read, and
// the controller's metrics port has nothing behind it) and Events, and
// reads the archive: the driver's objects and their Events are in it,
// the other provisioner's and the unrelated Event are not, nor is the
// Secret, nor any managedFields; the failures are in the summary and on
// stderr, and the bundle is complete regardless.
func TestSupportBundleAgainstAPIServer(t *testing.T) {
	cfg, c := apiserver.Start(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	ns := nodePluginNamespace
	create := func(objs ...client.Object) {
		t.Helper()
		for _, o := range objs {
			if err := c.Create(ctx, o); err != nil {
				t.Fatalf("creating %T %s: %v", o, o.GetName(), err)
			}
		}
	}
	const secretValue = "s3cr3t-ca-key-0f9c7e1b"
	driverLabelsOf := func(component string) map[string]string {
		return map[string]string{"app.kubernetes.io/name": "mpnbd", "app.kubernetes.io/component": component}
	}
	create(
		&corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}},
		&corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "apps"}},
		&corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "default"}},
		&corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "mpnbd-ca"}, StringData: map[string]string{"tls.key": secretValue}},
		&corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "mpnbd-config"}, Data: map[string]string{"transport": "fuse-kept"}},
		// The driver's workloads: how its namespace is found.
		&appsv1.DaemonSet{
			ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "mpnbd-node", Labels: driverLabelsOf("node")},
			Spec: appsv1.DaemonSetSpec{
				Selector: &metav1.LabelSelector{MatchLabels: driverLabelsOf("node")},
				Template: corev1.PodTemplateSpec{
					ObjectMeta: metav1.ObjectMeta{Labels: driverLabelsOf("node")},
					Spec:       corev1.PodSpec{Containers: []corev1.Container{{Name: "node", Image: "mpnbd:test"}}},
				},
			},
		},
		newVolume("pvc-1", v1alpha1.VolumeAvailable, "node-a"),
		&v1alpha1.NBDStorageNode{ObjectMeta: metav1.ObjectMeta{Name: "storage-1"}},
		&storagev1.CSIDriver{ObjectMeta: metav1.ObjectMeta{Name: driver.DriverName}},
		&storagev1.StorageClass{ObjectMeta: metav1.ObjectMeta{Name: "mpnbd-fuse"}, Provisioner: driver.DriverName},
		&storagev1.StorageClass{ObjectMeta: metav1.ObjectMeta{Name: "other-class"}, Provisioner: "other.example.com"},
		newPV("pvc-1", "apps/data"),
		newPVC("apps/data", "pvc-1"),
		newNode("node-a", "192.0.2.1"),
		// A claim of the driver's class waiting for its volume.
		&corev1.PersistentVolumeClaim{
			ObjectMeta: metav1.ObjectMeta{Namespace: "apps", Name: "pending"},
			Spec: corev1.PersistentVolumeClaimSpec{
				AccessModes:      []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
				Resources:        corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: newPV("x", "a/b").Spec.Capacity[corev1.ResourceStorage]}},
				StorageClassName: new("mpnbd-fuse"),
			},
		},
	)
	otherPV := newPV("other-pv", "apps/other-claim")
	otherPV.Spec.CSI.Driver = "other.example.com"
	create(otherPV, newPVC("apps/other-claim", "other-pv"))

	// The node plugin's metrics through the pod proxy, where this host
	// has an address the API server proxies to; the controller's metrics
	// port has nothing behind it.
	addr := hostAddress(t)
	pluginIP, pluginPort := "192.0.2.1", int32(9811)
	if addr != "" {
		u, err := url.Parse(nodePluginAt(t, addr, "node-a", map[string]fakeVolume{
			"pvc-1": {attach.Relay, 2, attach.Health{Connected: true, MPTCP: true, Subflows: []int{2}}},
		}))
		if err != nil {
			t.Fatal(err)
		}
		port, _ := strconv.Atoi(u.Port())
		pluginIP, pluginPort = addr, int32(port)
	} else {
		fmt.Fprintf(os.Stderr, "%s: no address of this host the API server proxies to: the node plugin's metrics are not read\n", t.Name())
	}
	plugin := newNodePluginPod("plugin-a", "node-a", pluginPort, corev1.PodRunning, pluginIP)
	// It restarted: its previous log is asked for too.
	plugin.Status.ContainerStatuses = []corev1.ContainerStatus{
		{Name: "node", Image: "mpnbd:test", RestartCount: 2, Ready: true, State: corev1.ContainerState{Running: &corev1.ContainerStateRunning{}}},
		{Name: "liveness-probe", Image: "livenessprobe:test", Ready: true, State: corev1.ContainerState{Running: &corev1.ContainerStateRunning{}}},
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	gone := l.Addr().(*net.TCPAddr).Port
	l.Close()
	ctrl := newNodePluginPod("mpnbd-controller-0", "node-a", int32(gone), corev1.PodRunning, "192.0.2.2")
	ctrl.Labels["app.kubernetes.io/component"] = "controller"
	ctrl.Spec.Containers = ctrl.Spec.Containers[:1]
	ctrl.Spec.Containers[0].Name = "controller"
	// A pod of the namespace that is not the driver's: its spec is
	// there, but not its logs.
	other := newNodePluginPod("debug", "node-a", 0, corev1.PodRunning, "192.0.2.3")
	other.Labels = nil
	for _, p := range []*corev1.Pod{plugin, ctrl, other} {
		status := p.Status
		create(p)
		// As the kubelet does.
		p.Status = status
		if err := c.Status().Update(ctx, p); err != nil {
			t.Fatalf("status of pod %s: %v", p.Name, err)
		}
	}

	at := time.Now().Truncate(time.Second)
	event := func(ns, name string, obj corev1.ObjectReference, msg string) *corev1.Event {
		return &corev1.Event{
			ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name}, InvolvedObject: obj, Reason: "Test", Message: msg,
			Type: corev1.EventTypeWarning, FirstTimestamp: metav1.NewTime(at), LastTimestamp: metav1.NewTime(at), Count: 1,
		}
	}
	create(
		event("default", "pv-event", corev1.ObjectReference{Kind: "PersistentVolume", Name: "pvc-1"}, "event-on-the-drivers-pv"),
		newClaimEvent("apps/data", "node-a", driver.EventStorageUnreachable, "event-on-the-drivers-claim", at),
		event("default", "vol-event", corev1.ObjectReference{Kind: "NBDVolume", APIVersion: v1alpha1.GroupVersion.String(), Name: "pvc-1"}, "event-on-the-nbdvolume"),
		event("default", "node-event", corev1.ObjectReference{Kind: "Node", Name: "node-a"}, "event-on-the-node"),
		event(ns, "pod-event", corev1.ObjectReference{Kind: "Pod", Namespace: ns, Name: "plugin-a"}, "event-in-the-drivers-namespace"),
		event("default", "other-pv-event", corev1.ObjectReference{Kind: "PersistentVolume", Name: "other-pv"}, "event-on-another-pv"),
		event("apps", "other-claim-event", corev1.ObjectReference{Kind: "PersistentVolumeClaim", Namespace: "apps", Name: "other-claim"}, "event-on-another-claim"),
	)

	kc := apiserver.WriteKubeconfig(t, cfg)
	file := filepath.Join(t.TempDir(), "bundle.tar.gz")
	var out, errb bytes.Buffer
	if code := run(ctx, []string{"--kubeconfig", kc, "support-bundle", "-o", file, "--timeout", "10s"}, &out, &errb); code != 0 {
		t.Fatalf("support-bundle: exit %d: %s", code, errb.String())
	}
	t.Logf("stdout:\n%s\nstderr:\n%s", out.String(), errb.String())
	if !strings.HasPrefix(out.String(), "support bundle written to "+file+": ") {
		t.Errorf("stdout %q", out.String())
	}
	f, err := os.Open(file)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	files, dir, raw := readBundle(t, f)
	if !regexp.MustCompile(`^mpnbd-support-\d{8}T\d{6}Z$`).MatchString(dir) {
		t.Errorf("the bundle's directory %q", dir)
	}
	summary := files[summaryFile]
	t.Logf("%s:\n%s", summaryFile, summary)

	has := func(file string, want ...string) {
		t.Helper()
		s, ok := files[file]
		if !ok {
			t.Errorf("no %s in the bundle", file)
			return
		}
		for _, w := range want {
			if !strings.Contains(s, w) {
				t.Errorf("%s lacks %q:\n%s", file, w, s)
			}
		}
	}
	lacks := func(file string, unwanted ...string) {
		t.Helper()
		for _, u := range unwanted {
			if strings.Contains(files[file], u) {
				t.Errorf("%s holds %q:\n%s", file, u, files[file])
			}
		}
	}
	nsDir := "namespaces/" + ns + "/"
	has("mpnbd/nbdvolumes.yaml", "kind: NBDVolume\n", "name: pvc-1\n", "storageNode: storage-1")
	has("mpnbd/nbdstoragenodes.yaml", "kind: NBDStorageNode\n", "name: storage-1\n")
	has("mpnbd/nbdsnapshots.yaml", "kind: List\n", "items: []")
	has("cluster/csidrivers.yaml", "name: "+driver.DriverName+"\n")
	has("cluster/storageclasses.yaml", "name: mpnbd-fuse\n")
	lacks("cluster/storageclasses.yaml", "other-class", "other.example.com")
	has("cluster/persistentvolumes.yaml", "kind: PersistentVolume\n", "name: pvc-1\n")
	lacks("cluster/persistentvolumes.yaml", "other-pv", "other.example.com")
	has("cluster/persistentvolumeclaims.yaml", "name: data\n", "name: pending\n")
	lacks("cluster/persistentvolumeclaims.yaml", "other-claim")
	has("cluster/nodes.yaml", "name: node-a\n")
	has("cluster/csinodes.yaml", "items: []")
	has("cluster/volumeattachments.yaml", "kind: List\n")
	has(nsDir+"pods.yaml", "name: plugin-a\n", "name: mpnbd-controller-0\n", "name: debug\n")
	has(nsDir+"daemonsets.yaml", "name: mpnbd-node\n")
	has(nsDir+"deployments.yaml", "items: []")
	has(nsDir+"configmaps.yaml", "name: mpnbd-config\n", "transport: fuse-kept")
	has(nsDir+"leases.yaml", "kind: List\n")
	has("version.txt", "mpnbdctl "+buildinfo.Version+" (revision ", "mpnbd-node", "mpnbd:test")
	// The Events of what was collected and of the driver's namespace;
	// not another PV's or claim's.
	has("events.yaml", "event-on-the-drivers-pv", "event-on-the-drivers-claim", "event-on-the-nbdvolume", "event-on-the-node", "event-in-the-drivers-namespace")
	lacks("events.yaml", "event-on-another-pv", "event-on-another-claim")

	// No Secret: not its value (as given, nor as the API stores it), not
	// its name, anywhere in the archive.
	for _, s := range []string{secretValue, base64.StdEncoding.EncodeToString([]byte(secretValue)), "mpnbd-ca"} {
		if bytes.Contains(raw, []byte(s)) {
			t.Errorf("the archive holds %q of the Secret", s)
		}
	}
	for name := range files {
		if strings.Contains(name, "secret") {
			t.Errorf("the bundle has %s", name)
		}
	}
	if bytes.Contains(raw, []byte("managedFields")) {
		t.Error("the archive holds managedFields")
	}

	// No kubelet: each log of the driver's pods is an error, in the
	// summary and on stderr, the previous one of the restarted
	// container too; none of the pod that is not the driver's.
	wantErrs := []string{
		"log of pod " + ns + "/plugin-a container node: GET ",
		"previous log of pod " + ns + "/plugin-a container node: GET ",
		"log of pod " + ns + "/plugin-a container liveness-probe: GET ",
		"log of pod " + ns + "/mpnbd-controller-0 container controller: GET ",
		fmt.Sprintf("metrics of pod %s/mpnbd-controller-0 port %d: GET ", ns, gone),
	}
	metricsFile := "metrics/" + ns + "/plugin-a.txt"
	if addr != "" {
		has(metricsFile, "mpnbd_node_volume_connected{", `volume="pvc-1"`)
	} else {
		wantErrs = append(wantErrs, fmt.Sprintf("metrics of pod %s/plugin-a port %d: GET ", ns, pluginPort))
	}
	for _, w := range wantErrs {
		if !strings.Contains(summary, "  "+w) || !strings.Contains(errb.String(), "mpnbdctl: support-bundle: "+w) {
			t.Errorf("the summary or stderr lacks the error %q", w)
		}
	}
	if strings.Contains(summary, "previous log of pod "+ns+"/plugin-a container liveness-probe") || strings.Contains(summary, "/debug") {
		t.Errorf("a log asked for that is not there to read:\n%s", summary)
	}
	n := len(wantErrs)
	if !strings.Contains(summary, fmt.Sprintf("\nErrors (%d):\n", n)) || !strings.Contains(out.String(), fmt.Sprintf(" %d collection errors", n)) {
		t.Errorf("want %d errors", n)
	}
	for _, s := range []string{
		"Driver namespaces: " + ns + "\n",
		"cluster/persistentvolumes.yaml", "1 of kind PersistentVolume\n",
		"events.yaml", "5 of kind Event\n",
		// No snapshot API on this API server: skipped, no error.
		"Skipped (2):\n  cluster/volumesnapshotclasses.yaml: the API snapshot.storage.k8s.io/v1 is not installed",
	} {
		if !strings.Contains(summary, s) {
			t.Errorf("the summary lacks %q", s)
		}
	}
	for name := range files {
		if name != summaryFile && !strings.Contains(summary, "  "+name+" ") {
			t.Errorf("the summary does not list %s", name)
		}
	}

	// To stdout, the driver's namespace named: the same bundle, the
	// message on stderr.
	out.Reset()
	errb.Reset()
	if code := run(ctx, []string{"--kubeconfig", kc, "support-bundle", "-n", ns, "-o", "-", "--timeout", "10s"}, &out, &errb); code != 0 {
		t.Fatalf("support-bundle -o -: exit %d: %s", code, errb.String())
	}
	files, _, _ = readBundle(t, &out)
	if _, ok := files[nsDir+"configmaps.yaml"]; !ok || !strings.Contains(files[summaryFile], "Driver namespaces: "+ns+"\n") ||
		!strings.Contains(errb.String(), "support bundle written to stdout: ") {
		t.Errorf("-o -: files %d, stderr %s", len(files), errb.String())
	}

	// An archive that cannot be written fails.
	out.Reset()
	errb.Reset()
	bad := filepath.Join(t.TempDir(), "no-such-dir", "b.tar.gz")
	if code := run(ctx, []string{"--kubeconfig", kc, "support-bundle", "-o", bad}, &out, &errb); code != 1 || !strings.Contains(errb.String(), "no-such-dir") {
		t.Errorf("support-bundle -o %s: exit %d, stderr %s", bad, code, errb.String())
	}
}
