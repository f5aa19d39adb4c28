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
	"cmp"
	"compress/gzip"
	"context"
	"errors"
	"fmt"
	"io"
	"maps"
	"net/url"
	"os"
	"path"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/yaml"

	"github.com/mpnbd/mpnbd/api/v1alpha1"
	"github.com/mpnbd/mpnbd/pkg/driver"
)

// The defaults of --since and --log-bytes: a day of each container's log,
// at most its last 10 MiB, keeps a bundle of a few dozen pods small
// enough to mail and still covers the fault being looked at.
const (
	defaultLogSince = 24 * time.Hour
	defaultLogBytes = 10 << 20
)

// bundleWorkers bounds the logs and metrics read at once: each holds up
// to --log-bytes in memory, and the API server serves them all.
const bundleWorkers = 4

// minLogTimeout is the least time one container's log is given: a day of
// log takes longer to stream than a list takes to answer (--timeout).
const minLogTimeout = time.Minute

// summaryFile is the bundle's index.
const summaryFile = "summary.txt"

// The kinds of the Kubernetes objects the bundle holds besides the
// driver's own. Secrets are not among them, and are never even listed:
// the bundle is meant to leave the cluster.
var (
	gvkCSIDriver     = schema.GroupVersionKind{Group: "storage.k8s.io", Version: "v1", Kind: "CSIDriver"}
	gvkCSINode       = schema.GroupVersionKind{Group: "storage.k8s.io", Version: "v1", Kind: "CSINode"}
	gvkStorageClass  = schema.GroupVersionKind{Group: "storage.k8s.io", Version: "v1", Kind: "StorageClass"}
	gvkAttachment    = schema.GroupVersionKind{Group: "storage.k8s.io", Version: "v1", Kind: "VolumeAttachment"}
	gvkPV            = corev1.SchemeGroupVersion.WithKind("PersistentVolume")
	gvkPVC           = corev1.SchemeGroupVersion.WithKind("PersistentVolumeClaim")
	gvkNode          = corev1.SchemeGroupVersion.WithKind("Node")
	gvkPod           = corev1.SchemeGroupVersion.WithKind("Pod")
	gvkConfigMap     = corev1.SchemeGroupVersion.WithKind("ConfigMap")
	gvkEvent         = corev1.SchemeGroupVersion.WithKind("Event")
	gvkDaemonSet     = schema.GroupVersionKind{Group: "apps", Version: "v1", Kind: "DaemonSet"}
	gvkDeployment    = schema.GroupVersionKind{Group: "apps", Version: "v1", Kind: "Deployment"}
	gvkLease         = schema.GroupVersionKind{Group: "coordination.k8s.io", Version: "v1", Kind: "Lease"}
	gvkSnapshotClass = schema.GroupVersionKind{Group: "snapshot.storage.k8s.io", Version: "v1", Kind: "VolumeSnapshotClass"}
	gvkSnapContent   = schema.GroupVersionKind{Group: "snapshot.storage.k8s.io", Version: "v1", Kind: "VolumeSnapshotContent"}
)

// bundle is a support bundle being written: a gzipped tar of files under
// one directory, and what went into it.
type bundle struct {
	ctx  context.Context
	o    *options
	conn *apiConn
	// stderr hears of each collection error as it happens.
	stderr io.Writer
	at     time.Time
	// dir is the directory in the archive every file is under.
	dir string

	mu sync.Mutex
	tw *tar.Writer
	// files are what was written, by path, and what each holds.
	files map[string]string
	// errs are the collection errors; skipped the parts left out on
	// purpose.
	errs    []string
	skipped []string
	// writeErr is the first failure to write the archive: fatal.
	writeErr error

	// What the objects collected so far say, for those collected next:
	// the driver's namespaces, StorageClasses and PVs, and the objects
	// whose Events belong in the bundle (involvedKey).
	namespaces []string
	classes    map[string]bool
	pvs        map[string]bool
	involved   map[string]bool
	// pods are the driver's pods, whose logs and metrics are read.
	pods []corev1.Pod
}

// bundleName is the file name of a bundle made at: the default of -o,
// and without .tar.gz the directory inside it.
func bundleName(at time.Time) string {
	return "mpnbd-support-" + at.UTC().Format("20060102T150405Z") + ".tar.gz"
}

// supportBundle writes a support bundle to o.output ("": bundleName in the
// current directory; "-": stdout), saying where on stdout (stderr when
// the bundle is stdout). What cannot be collected is recorded in the
// bundle's summary and on stderr; only a failure to write the archive
// fails.
func supportBundle(ctx context.Context, o *options, conn *apiConn, stdout, stderr io.Writer) error {
	at := time.Now().UTC()
	name := cmp.Or(o.output, bundleName(at))
	out := stdout
	var f *os.File
	if name != "-" {
		var err error
		// Logs and ConfigMaps are for support's eyes only.
		if f, err = os.OpenFile(name, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o600); err != nil {
			return fmt.Errorf("support bundle: %w", err)
		}
		out = f
	}
	gz := gzip.NewWriter(out)
	b := &bundle{
		ctx: ctx, o: o, conn: conn, stderr: stderr, at: at,
		dir: strings.TrimSuffix(bundleName(at), ".tar.gz"), tw: tar.NewWriter(gz), files: map[string]string{},
		involved: map[string]bool{},
	}
	b.collect()
	b.writeSummary()
	err := errors.Join(b.writeErr, b.tw.Close(), gz.Close())
	if f != nil {
		err = errors.Join(err, f.Close())
	}
	if err != nil {
		if f != nil {
			_ = os.Remove(name)
		}
		return fmt.Errorf("writing support bundle %s: %w", name, err)
	}
	msg := stdout
	if name == "-" {
		msg, name = stderr, "stdout"
	}
	fmt.Fprintf(msg, "support bundle written to %s: %d files, %d collection errors (listed in its %s)\n", name, len(b.files), len(b.errs), summaryFile)
	return nil
}

// collect reads everything the bundle holds into it, each part on its
// own: one that fails is an error in the summary.
func (b *bundle) collect() {
	b.findNamespaces()
	b.add("version.txt", b.versionText(), "mpnbdctl version: this client, and the image each of the driver's workloads runs")

	// The driver's own kinds: every kind of api/v1alpha1 (a kind with a
	// List), so that a new one is not forgotten.
	api := b.conn.client
	var own []string
	for kind := range api.Scheme().KnownTypes(v1alpha1.GroupVersion) {
		if !strings.HasSuffix(kind, "List") && api.Scheme().Recognizes(v1alpha1.GroupVersion.WithKind(kind+"List")) {
			own = append(own, kind)
		}
	}
	slices.Sort(own)
	for _, kind := range own {
		b.objects("mpnbd", v1alpha1.GroupVersion.WithKind(kind), "", false, nil)
	}

	name := func(u *unstructured.Unstructured, fields ...string) string {
		s, _, _ := unstructured.NestedString(u.Object, fields...)
		return s
	}
	isDriver := func(fields ...string) func(*unstructured.Unstructured) bool {
		return func(u *unstructured.Unstructured) bool { return name(u, fields...) == driver.DriverName }
	}
	b.objects("cluster", gvkCSIDriver, "", false, func(u *unstructured.Unstructured) bool { return u.GetName() == driver.DriverName })
	// Every CSINode: those without the driver show where it is not
	// registered.
	b.objects("cluster", gvkCSINode, "", false, nil)
	b.classes = map[string]bool{}
	for _, sc := range b.objects("cluster", gvkStorageClass, "", false, isDriver("provisioner")) {
		b.classes[sc.GetName()] = true
	}
	b.pvs = map[string]bool{}
	for _, pv := range b.objects("cluster", gvkPV, "", false, isDriver("spec", "csi", "driver")) {
		b.pvs[pv.GetName()] = true
	}
	// The claims bound to the driver's PVs, and those of its classes
	// still waiting for one (a provisioning that fails).
	b.objects("cluster", gvkPVC, "", false, func(u *unstructured.Unstructured) bool {
		return b.pvs[name(u, "spec", "volumeName")] || b.classes[name(u, "spec", "storageClassName")]
	})
	b.objects("cluster", gvkAttachment, "", false, isDriver("spec", "attacher"))
	b.objects("cluster", gvkSnapshotClass, "", true, isDriver("driver"))
	b.objects("cluster", gvkSnapContent, "", true, isDriver("spec", "driver"))
	b.objects("cluster", gvkNode, "", false, nil)

	for _, ns := range b.namespaces {
		dir := path.Join("namespaces", ns)
		for _, u := range b.objects(dir, gvkPod, ns, false, nil) {
			var p corev1.Pod
			if err := runtime.DefaultUnstructuredConverter.FromUnstructured(u.Object, &p); err != nil {
				b.fail("reading pod %s/%s: %v", ns, u.GetName(), err)
				continue
			}
			if labels.SelectorFromSet(driverLabels).Matches(labels.Set(p.Labels)) {
				b.pods = append(b.pods, p)
			}
		}
		b.objects(dir, gvkDaemonSet, ns, false, nil)
		b.objects(dir, gvkDeployment, ns, false, nil)
		b.objects(dir, gvkConfigMap, ns, false, nil)
		b.objects(dir, gvkLease, ns, false, nil)
	}
	b.events()
	b.podData()
}

// findNamespaces sets the driver's namespaces: -n, else those of its
// Deployments and DaemonSets (labelled app.kubernetes.io/name=mpnbd).
func (b *bundle) findNamespaces() {
	if b.o.namespace != "" {
		b.namespaces = []string{b.o.namespace}
		return
	}
	var rep VersionReport
	if err := readComponents(b.ctx, b.o, b.conn.client, &rep); err != nil {
		b.fail("finding the driver's namespaces: %v", err)
	}
	for _, w := range rep.Warnings {
		b.fail("finding the driver's namespaces: %s", w)
	}
	for _, c := range rep.Components {
		b.namespaces = append(b.namespaces, c.Namespace)
	}
	slices.Sort(b.namespaces)
	b.namespaces = slices.Compact(b.namespaces)
	if len(b.namespaces) == 0 {
		b.fail("no Deployment or DaemonSet labelled %s in any namespace: no pods, logs or metrics collected (-n names the driver's namespace)",
			labels.SelectorFromSet(driverLabels))
	}
}

// versionText is what `mpnbdctl version` prints.
func (b *bundle) versionText() []byte {
	vo := *b.o
	vo.output = outputTable
	var buf bytes.Buffer
	if err := version(b.ctx, &vo, b.conn.client, nil, &buf); err != nil {
		b.fail("mpnbdctl version: %v", err)
	}
	return buf.Bytes()
}

// involvedKey names an object as an Event's involvedObject does.
func involvedKey(kind, ns, name string) string {
	return kind + "/" + ns + "/" + name
}

// objects lists the objects of kind gvk (in namespace ns, or the
// cluster's), keeps those keep says concern the driver (nil: all), and
// writes them, without their managedFields, to DIR/RESOURCE.yaml as a
// List. optional: an API server without the kind skips it, said in the
// summary but no error. The objects kept are returned, and their Events
// will be collected.
func (b *bundle) objects(dir string, gvk schema.GroupVersionKind, ns string, optional bool, keep func(*unstructured.Unstructured) bool) []unstructured.Unstructured {
	api := b.conn.client
	// Named after its resource; guessed from its kind when the API
	// server does not know it.
	res, _ := meta.UnsafeGuessKindToResource(gvk)
	if m, err := api.RESTMapper().RESTMapping(gvk.GroupKind(), gvk.Version); err == nil {
		res = m.Resource
	}
	file := path.Join(dir, res.Resource+".yaml")
	list := &unstructured.UnstructuredList{}
	list.SetGroupVersionKind(gvk.GroupVersion().WithKind(gvk.Kind + "List"))
	var opts []client.ListOption
	if ns != "" {
		opts = append(opts, client.InNamespace(ns))
	}
	if err := b.list(list, opts...); err != nil {
		what := fmt.Sprintf("listing %ss for %s", gvk.Kind, file)
		switch {
		case optional && meta.IsNoMatchError(err):
			b.skip("%s: the API %s is not installed", file, gvk.GroupVersion())
		case gvk.GroupVersion() == v1alpha1.GroupVersion:
			b.fail("%v", apiError(what, err))
		default:
			b.fail("%s: %v", what, err)
		}
		return nil
	}
	var kept []unstructured.Unstructured
	for _, u := range list.Items {
		if keep == nil || keep(&u) {
			kept = append(kept, u)
		}
	}
	slices.SortFunc(kept, func(a, b unstructured.Unstructured) int {
		return cmp.Or(strings.Compare(a.GetNamespace(), b.GetNamespace()), strings.Compare(a.GetName(), b.GetName()))
	})
	for _, u := range kept {
		b.involved[involvedKey(gvk.Kind, u.GetNamespace(), u.GetName())] = true
	}
	b.writeList(file, kept, fmt.Sprintf("%d of kind %s", len(kept), gvk.Kind))
	return kept
}

// list lists into l within --timeout.
func (b *bundle) list(l client.ObjectList, opts ...client.ListOption) error {
	ctx, cancel := context.WithTimeout(b.ctx, b.o.timeout)
	defer cancel()
	return b.conn.client.List(ctx, l, opts...)
}

// writeList writes items as a v1 List in YAML, without their
// managedFields (the field managers' bookkeeping, half of an object and
// no help to a reader).
func (b *bundle) writeList(file string, items []unstructured.Unstructured, what string) {
	out := make([]any, 0, len(items))
	for _, u := range items {
		unstructured.RemoveNestedField(u.Object, "metadata", "managedFields")
		out = append(out, u.Object)
	}
	data, err := yaml.Marshal(map[string]any{"apiVersion": "v1", "kind": "List", "items": out})
	if err != nil {
		b.fail("%s: %v", file, err)
		return
	}
	b.add(file, data, what)
}

// events collects the Events of the driver's namespaces and those whose
// involvedObject is an object collected (PVs, claims in their
// namespaces, the driver's objects, Nodes...), oldest first, in
// events.yaml.
func (b *bundle) events() {
	byUID := map[string]unstructured.Unstructured{}
	list := func(what string, opts ...client.ListOption) []unstructured.Unstructured {
		l := &unstructured.UnstructuredList{}
		l.SetGroupVersionKind(gvkEvent.GroupVersion().WithKind("EventList"))
		if err := b.list(l, opts...); err != nil {
			b.fail("listing the Events %s: %v", what, err)
			return nil
		}
		return l.Items
	}
	for _, ns := range b.namespaces {
		for _, e := range list("of namespace "+ns, client.InNamespace(ns)) {
			byUID[string(e.GetUID())] = e
		}
	}
	// One list per kind of object collected, by field selector, rather
	// than every Event of the cluster.
	kinds := map[string]bool{}
	for k := range b.involved {
		kind, _, _ := strings.Cut(k, "/")
		kinds[kind] = true
	}
	for _, kind := range slices.Sorted(maps.Keys(kinds)) {
		for _, e := range list("on "+kind+"s", client.MatchingFields{"involvedObject.kind": kind}) {
			ns, _, _ := unstructured.NestedString(e.Object, "involvedObject", "namespace")
			name, _, _ := unstructured.NestedString(e.Object, "involvedObject", "name")
			if b.involved[involvedKey(kind, ns, name)] {
				byUID[string(e.GetUID())] = e
			}
		}
	}
	events := make([]unstructured.Unstructured, 0, len(byUID))
	for _, e := range byUID {
		events = append(events, e)
	}
	when := func(e *unstructured.Unstructured) string {
		for _, f := range [][]string{{"lastTimestamp"}, {"eventTime"}, {"metadata", "creationTimestamp"}} {
			if s, _, _ := unstructured.NestedString(e.Object, f...); s != "" {
				return s
			}
		}
		return ""
	}
	slices.SortFunc(events, func(a, b unstructured.Unstructured) int {
		return cmp.Or(strings.Compare(when(&a), when(&b)), strings.Compare(a.GetNamespace(), b.GetNamespace()), strings.Compare(a.GetName(), b.GetName()))
	})
	b.writeList("events.yaml", events, fmt.Sprintf("%d of kind Event", len(events)))
}

// podData reads, for each of the driver's pods, the log of every
// container (and its previous one's, when it restarted) and the metrics
// of the pod's port named metrics, through the API server, bundleWorkers
// at a time.
func (b *bundle) podData() {
	var jobs []func()
	for _, p := range b.pods {
		dir := path.Join(p.Namespace, p.Name)
		restarts := map[string]int32{}
		for _, s := range slices.Concat(p.Status.InitContainerStatuses, p.Status.ContainerStatuses) {
			restarts[s.Name] = s.RestartCount
		}
		for _, c := range slices.Concat(p.Spec.InitContainers, p.Spec.Containers) {
			jobs = append(jobs, func() { b.log(p, c.Name, false, path.Join("logs", dir, c.Name+".log")) })
			if restarts[c.Name] > 0 {
				jobs = append(jobs, func() { b.log(p, c.Name, true, path.Join("logs", dir, c.Name+".previous.log")) })
			}
		}
		if port := metricsPort(&p); port != 0 {
			jobs = append(jobs, func() { b.metrics(p, port, path.Join("metrics", dir+".txt")) })
		}
	}
	work := make(chan func())
	var wg sync.WaitGroup
	for range min(bundleWorkers, len(jobs)) {
		wg.Go(func() {
			for job := range work {
				job()
			}
		})
	}
	for _, job := range jobs {
		work <- job
	}
	close(work)
	wg.Wait()
}

// log reads the log of pod p's container (of its previous instance:
// previous) since --since, keeping its last --log-bytes.
func (b *bundle) log(p corev1.Pod, container string, previous bool, file string) {
	q := url.Values{"container": {container}, "timestamps": {"true"}}
	if previous {
		q.Set("previous", "true")
	}
	if b.o.since > 0 {
		q.Set("sinceSeconds", strconv.FormatInt(int64(b.o.since.Round(time.Second)/time.Second), 10))
	}
	what := fmt.Sprintf("log of pod %s/%s container %s", p.Namespace, p.Name, container)
	if previous {
		what = "previous " + what
	}
	ctx, cancel := context.WithTimeout(b.ctx, max(b.o.timeout, minLogTimeout))
	defer cancel()
	body, err := get(ctx, b.conn.proxy.hc, b.conn.proxy.podLogURL(p.Namespace, p.Name, q), "", true, needLog)
	if err != nil {
		b.fail("%s: %v", what, err)
		return
	}
	defer body.Close()
	t := newTailWriter(b.o.logBytes)
	_, err = io.Copy(t, body)
	// What was read is kept even when the stream broke off.
	b.add(file, t.text(), what)
	if err != nil {
		b.fail("%s: cut short: %v", what, err)
	}
}

// metrics reads the /metrics of pod p's port through the API server's
// pod proxy, as the volumes' data paths are read.
func (b *bundle) metrics(p corev1.Pod, port int32, file string) {
	what := fmt.Sprintf("metrics of pod %s/%s port %d", p.Namespace, p.Name, port)
	ctx, cancel := context.WithTimeout(b.ctx, b.o.timeout)
	defer cancel()
	body, err := get(ctx, b.conn.proxy.hc, b.conn.proxy.podURL(p.Namespace, p.Name, port, "metrics"), acceptMetrics, true, needProxy)
	if err != nil {
		b.fail("%s: %v", what, err)
		return
	}
	defer body.Close()
	data, err := io.ReadAll(io.LimitReader(body, maxMetricsBytes))
	if err != nil {
		b.fail("%s: %v", what, err)
		return
	}
	b.add(file, data, what)
}

// add writes the file name (under the bundle's directory) holding data;
// what says in the summary what it is.
func (b *bundle) add(name string, data []byte, what string) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.writeErr != nil {
		return
	}
	hdr := &tar.Header{Typeflag: tar.TypeReg, Name: path.Join(b.dir, name), Mode: 0o600, Size: int64(len(data)), ModTime: b.at}
	if err := b.tw.WriteHeader(hdr); err != nil {
		b.writeErr = err
		return
	}
	if _, err := b.tw.Write(data); err != nil {
		b.writeErr = err
		return
	}
	b.files[name] = what
}

// fail records a collection error, and says it on stderr at once.
func (b *bundle) fail(format string, args ...any) {
	msg := fmt.Sprintf(format, args...)
	b.mu.Lock()
	defer b.mu.Unlock()
	b.errs = append(b.errs, msg)
	fmt.Fprintf(b.stderr, "mpnbdctl: support-bundle: %s\n", msg)
}

// skip records a part left out on purpose.
func (b *bundle) skip(format string, args ...any) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.skipped = append(b.skipped, fmt.Sprintf(format, args...))
}

// writeSummary writes the bundle's index: how it was made, every file
// and what it holds, what was skipped and every collection error. It
// runs once everything else is written.
func (b *bundle) writeSummary() {
	var s strings.Builder
	fmt.Fprintf(&s, "mpnbd support bundle, made %s by mpnbdctl support-bundle\n", b.at.Format(time.RFC3339))
	fmt.Fprintf(&s, "API server: %s\n", b.conn.proxy.base.Redacted())
	fmt.Fprintf(&s, "Driver namespaces: %s\n", cmp.Or(strings.Join(b.namespaces, ", "), "none found"))
	since := "all"
	if b.o.since > 0 {
		since = "the last " + b.o.since.String()
	}
	fmt.Fprintf(&s, "Logs: %s of each container's, at most its last %d bytes\n", since, b.o.logBytes)
	s.WriteString("Secrets: none (not even listed)\n")
	fmt.Fprintf(&s, "\nFiles (%d):\n", len(b.files))
	tw := newTabWriter(&s)
	for _, name := range slices.Sorted(maps.Keys(b.files)) {
		row(tw, "  ", name, b.files[name])
	}
	_ = tw.Flush()
	if len(b.skipped) > 0 {
		fmt.Fprintf(&s, "\nSkipped (%d):\n", len(b.skipped))
		for _, m := range b.skipped {
			fmt.Fprintf(&s, "  %s\n", m)
		}
	}
	// Sorted: the logs and metrics are read in parallel.
	fmt.Fprintf(&s, "\nErrors (%d):\n", len(b.errs))
	for _, m := range slices.Sorted(slices.Values(b.errs)) {
		fmt.Fprintf(&s, "  %s\n", m)
	}
	b.add(summaryFile, []byte(s.String()), "this index")
}

// tailWriter keeps the last max bytes written to it, in a ring, so that
// a log of any length is read in bounded memory.
type tailWriter struct {
	buf []byte
	// next is where the next byte goes; full: buf has wrapped.
	next int
	full bool
	// total counts every byte written.
	total int64
}

func newTailWriter(maxBytes int) *tailWriter {
	return &tailWriter{buf: make([]byte, maxBytes)}
}

func (t *tailWriter) Write(p []byte) (int, error) {
	n := len(p)
	t.total += int64(n)
	if len(t.buf) == 0 {
		return n, nil
	}
	if len(p) >= len(t.buf) {
		p = p[len(p)-len(t.buf):]
	}
	for len(p) > 0 {
		c := copy(t.buf[t.next:], p)
		p = p[c:]
		t.next += c
		if t.next == len(t.buf) {
			t.next, t.full = 0, true
		}
	}
	return n, nil
}

// text is what was kept; when bytes were cut, from the first whole line
// on, after a line saying how many bytes were left out.
func (t *tailWriter) text() []byte {
	if !t.full {
		return t.buf[:t.next]
	}
	kept := slices.Concat(t.buf[t.next:], t.buf[:t.next])
	if t.total == int64(len(kept)) {
		return kept
	}
	if i := bytes.IndexByte(kept, '\n'); i >= 0 && i < len(kept)-1 {
		kept = kept[i+1:]
	}
	note := fmt.Sprintf("[mpnbdctl: the first %d bytes of this log left out: the last %d bytes kept (--log-bytes)]\n", t.total-int64(len(kept)), len(kept))
	return append([]byte(note), kept...)
}
