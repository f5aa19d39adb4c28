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

package agent

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-logr/logr"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/util/retry"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller/controllerutil"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"

	"github.com/mpnbd/mpnbd/api/v1alpha1"
	"github.com/mpnbd/mpnbd/internal/testenv/apiserver"
	"github.com/mpnbd/mpnbd/pkg/access"
	"github.com/mpnbd/mpnbd/pkg/mptcp"
	"github.com/mpnbd/mpnbd/pkg/nbd"
)

const (
	testNode      = "storage-1"
	testNamespace = "mpnbd"
	// deadline bounds every wait for the agent to converge.
	deadline = 30 * time.Second
)

func testLogger(t *testing.T) *slog.Logger {
	if testing.Verbose() {
		return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	return slog.New(slog.NewTextHandler(io.Discard, nil))
}

// running is one agent process: an NBD server on an MPTCP listener and a
// manager running the agent.
type running struct {
	agent *Agent
	srv   *nbd.Server
	addr  string
	obs   *recordingObserver
	stop  func()
}

// recordingObserver is an ExportObserver that keeps what it was told.
type recordingObserver struct {
	mu                  sync.Mutex
	exports             map[string]bool
	capacity, available int64
	reports             int
	stray               map[string]int
}

func (o *recordingObserver) StrayJoin(name string) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.stray == nil {
		o.stray = map[string]int{}
	}
	o.stray[name]++
}

func (o *recordingObserver) strays(name string) int {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.stray[name]
}

func (o *recordingObserver) ExportAdded(name string) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.exports[name] = true
}

func (o *recordingObserver) ExportRemoved(name string) {
	o.mu.Lock()
	defer o.mu.Unlock()
	delete(o.exports, name)
}

func (o *recordingObserver) Capacity(capacityBytes, availableBytes int64) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.capacity, o.available = capacityBytes, availableBytes
	o.reports++
}

// last returns the last capacity report and how many there were.
func (o *recordingObserver) last() (capacity, available int64, reports int) {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.capacity, o.available, o.reports
}

func startAgent(t *testing.T, cfg *rest.Config, dir string) *running {
	t.Helper()
	l, err := mptcp.Listen(context.Background(), "tcp", "127.0.0.1:0", true)
	if err != nil {
		t.Fatal(err)
	}
	return startAgentOn(t, cfg, dir, l, "127.0.0.1")
}

// startAgentOn is startAgent serving on l, reporting address addr; each
// of with may change the server and the agent's configuration first.
func startAgentOn(t *testing.T, cfg *rest.Config, dir string, l net.Listener, addr string, with ...func(*nbd.Server, *Config)) *running {
	t.Helper()
	log := testLogger(t)
	ctrl.SetLogger(logr.FromSlogHandler(log.Handler()))
	srv := &nbd.Server{Logger: log}
	served := make(chan struct{})
	go func() {
		defer close(served)
		srv.Serve(l)
	}()
	scheme, err := apiserver.Scheme()
	if err != nil {
		t.Fatal(err)
	}
	// The agent acts as its ServiceAccount with the deploy tree's RBAC:
	// what it needs and no more (no Secrets, say) is granted there.
	admin, err := client.New(cfg, client.Options{Scheme: scheme})
	if err != nil {
		t.Fatal(err)
	}
	if err := apiserver.Apply(context.Background(), admin, "deploy/rbac-storage-agent.yaml"); err != nil {
		t.Fatal(err)
	}
	obs := &recordingObserver{exports: map[string]bool{}}
	acfg := Config{
		NodeName:          testNode,
		Snapshots:         true,
		DataDir:           dir,
		Addresses:         []string{addr},
		Port:              int32(l.Addr().(*net.TCPAddr).Port),
		Topology:          map[string]string{"topology.mpnbd.io/node": testNode},
		HeartbeatInterval: 500 * time.Millisecond,
		DrainTimeout:      5 * time.Second,
		Exports:           obs,
		Logger:            log,
	}
	for _, f := range with {
		f(srv, &acfg)
	}
	// The agent of node acfg.NodeName (testNode unless with changed it).
	mgr, err := ctrl.NewManager(apiserver.As(cfg, "mpnbd-storage-agent", acfg.NodeName), ctrl.Options{
		Scheme:  scheme,
		Cache:   CacheOptions(acfg.NodeName, true),
		Metrics: metricsserver.Options{BindAddress: "0"},
	})
	if err != nil {
		t.Fatal(err)
	}
	a, err := New(acfg, srv, mgr.GetClient(), mgr.GetAPIReader())
	if err != nil {
		t.Fatal(err)
	}
	if !srv.DisableList || srv.Resolve == nil {
		t.Fatal("New did not install Resolve and DisableList")
	}
	if err := a.SetupWithManager(mgr); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- mgr.Start(ctx) }()
	r := &running{agent: a, srv: srv, addr: l.Addr().String(), obs: obs}
	stopped := false
	r.stop = func() {
		if stopped {
			return
		}
		stopped = true
		cancel()
		if err := <-done; err != nil {
			t.Errorf("manager: %v", err)
		}
		sctx, scancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer scancel()
		srv.Shutdown(sctx)
		<-served
		if err := a.Close(); err != nil {
			t.Errorf("closing the agent: %v", err)
		}
	}
	t.Cleanup(r.stop)
	return r
}

// eventually polls cond until it returns "" or the deadline passes.
func eventually(t *testing.T, what string, cond func() string) {
	t.Helper()
	end := time.Now().Add(deadline)
	last := ""
	for time.Now().Before(end) {
		if last = cond(); last == "" {
			return
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Fatalf("%s: still not done after %s: %s", what, deadline, last)
}

func newVolume(name string, size int64) *v1alpha1.NBDVolume {
	return &v1alpha1.NBDVolume{
		ObjectMeta: metav1.ObjectMeta{Name: name, Finalizers: []string{v1alpha1.Finalizer}},
		Spec: v1alpha1.NBDVolumeSpec{
			SizeBytes:   size,
			StorageNode: testNode,
			AccessType:  v1alpha1.AccessBlock,
		},
	}
}

func getVolume(t *testing.T, c client.Client, name string) *v1alpha1.NBDVolume {
	t.Helper()
	var v v1alpha1.NBDVolume
	if err := c.Get(context.Background(), types.NamespacedName{Name: name}, &v); err != nil {
		t.Fatal(err)
	}
	return &v
}

// waitObserved waits until the agent reports the volume's current
// generation and returns the volume.
func waitObserved(t *testing.T, c client.Client, name string) *v1alpha1.NBDVolume {
	t.Helper()
	var v *v1alpha1.NBDVolume
	eventually(t, "volume "+name+" observed", func() string {
		v = getVolume(t, c, name)
		if v.Status.ObservedGeneration != v.Generation {
			return fmt.Sprintf("observedGeneration %d, generation %d, phase %q", v.Status.ObservedGeneration, v.Generation, v.Status.Phase)
		}
		return ""
	})
	return v
}

// editVolume changes a volume's spec (retrying conflicts) and waits until
// the agent reports the new generation.
func editVolume(t *testing.T, c client.Client, name string, edit func(*v1alpha1.NBDVolume)) *v1alpha1.NBDVolume {
	t.Helper()
	err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		v := getVolume(t, c, name)
		edit(v)
		return c.Update(context.Background(), v)
	})
	if err != nil {
		t.Fatal(err)
	}
	return waitObserved(t, c, name)
}

// publish grants node access to volume and returns its token. As the
// controller does, the publication carries the token's hash and the
// node's addresses (127.0.0.1, where the tests dial from, unless given).
func publish(t *testing.T, c client.Client, volume, node string, readOnly bool, addrs ...string) string {
	t.Helper()
	tok := must(t, access.NewToken)
	if len(addrs) == 0 {
		addrs = []string{"127.0.0.1"}
	}
	editVolume(t, c, volume, func(v *v1alpha1.NBDVolume) {
		v.Spec.Publications = append(v.Spec.Publications, v1alpha1.Publication{
			NodeID: node, TokenSHA256: access.TokenHash(tok),
			Addresses: addrs, ReadOnly: readOnly,
		})
	})
	return tok
}

func unpublish(t *testing.T, c client.Client, volume, node string) {
	t.Helper()
	editVolume(t, c, volume, func(v *v1alpha1.NBDVolume) {
		v.Spec.Publications = slices.DeleteFunc(v.Spec.Publications, func(p v1alpha1.Publication) bool { return p.NodeID == node })
	})
}

// markDeleteData sets v1alpha1.DeleteDataAnnotation on a volume, as
// DeleteVolume does before it deletes the object.
func markDeleteData(t *testing.T, c client.Client, name string) {
	t.Helper()
	err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		v := getVolume(t, c, name)
		metav1.SetMetaDataAnnotation(&v.ObjectMeta, v1alpha1.DeleteDataAnnotation, v1alpha1.DeleteDataTrue)
		return c.Update(context.Background(), v)
	})
	if err != nil {
		t.Fatal(err)
	}
}

// deleteWithData deletes a volume the way DeleteVolume does: marked
// first, so that its backing file goes with it.
func deleteWithData(t *testing.T, c client.Client, name string) {
	t.Helper()
	markDeleteData(t, c, name)
	if err := c.Delete(context.Background(), getVolume(t, c, name)); err != nil {
		t.Fatal(err)
	}
}

// waitGone waits until a volume's object is gone.
func waitGone(t *testing.T, c client.Client, name string) {
	t.Helper()
	eventually(t, name+" gone", func() string {
		var v v1alpha1.NBDVolume
		err := c.Get(context.Background(), types.NamespacedName{Name: name}, &v)
		if apierrors.IsNotFound(err) {
			return ""
		}
		return fmt.Sprintf("finalizers %v, err %v", v.Finalizers, err)
	})
}

// waitOrphans waits until the storage node reports exactly want as its
// orphans.
func waitOrphans(t *testing.T, c client.Client, want ...string) {
	t.Helper()
	eventually(t, fmt.Sprintf("orphans %v reported", want), func() string {
		n := storageNode(t, c)
		if n == nil {
			return "no NBDStorageNode"
		}
		if !slices.Equal(n.Status.Orphans, want) {
			return fmt.Sprintf("orphans %v", n.Status.Orphans)
		}
		return ""
	})
}

func dial(t *testing.T, r *running, export string) (*nbd.Client, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	cl, err := nbd.Dial(ctx, nbd.DialOptions{Addr: r.addr, Export: export, MPTCP: true, Logger: testLogger(t)})
	if err == nil {
		t.Cleanup(func() { cl.Close() })
	}
	return cl, err
}

func mustDial(t *testing.T, r *running, export string) *nbd.Client {
	t.Helper()
	cl, err := dial(t, r, export)
	if err != nil {
		t.Fatalf("open %q: %v", export, err)
	}
	return cl
}

func refused(t *testing.T, r *running, what, export string) {
	t.Helper()
	cl, err := dial(t, r, export)
	if err == nil {
		cl.Close()
		t.Fatalf("%s: open %q succeeded", what, export)
	}
	if !errors.Is(err, nbd.ErrAccessDenied) && !errors.Is(err, nbd.ErrUnknownExport) {
		t.Fatalf("%s: open %q: %v, want a refusal", what, export, err)
	}
}

// knownSources checks the server's known sources (published addresses).
func knownSources(t *testing.T, r *running, want ...string) {
	t.Helper()
	var got []string
	for _, a := range r.srv.KnownSources() {
		got = append(got, a.String())
	}
	if !slices.Equal(got, want) {
		t.Fatalf("known sources %v, want %v", got, want)
	}
}

func storageNode(t *testing.T, c client.Client) *v1alpha1.NBDStorageNode {
	t.Helper()
	var n v1alpha1.NBDStorageNode
	err := c.Get(context.Background(), types.NamespacedName{Name: testNode}, &n)
	if apierrors.IsNotFound(err) {
		return nil
	}
	if err != nil {
		t.Fatal(err)
	}
	return &n
}

func fileSize(t *testing.T, path string) int64 {
	t.Helper()
	st, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	return st.Size()
}

// TestAgent runs the agent against a real API server and serves its
// volumes to the real NBD client over MPTCP on loopback.
func TestAgent(t *testing.T) {
	cfg, c := apiserver.Start(t)
	ctx := context.Background()
	if err := c.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: testNamespace}}); err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	r := startAgent(t, cfg, dir)
	const size = 16 << 20

	// A volume of another node is left alone.
	other := newVolume("elsewhere", 1<<20)
	other.Spec.StorageNode = "storage-2"
	if err := c.Create(ctx, other); err != nil {
		t.Fatal(err)
	}

	t.Run("create", func(t *testing.T) {
		if err := c.Create(ctx, newVolume("vol-a", size)); err != nil {
			t.Fatal(err)
		}
		v := waitObserved(t, c, "vol-a")
		st := v.Status
		if st.Phase != v1alpha1.VolumeAvailable || st.CapacityBytes != size || st.Code != "" || st.Message != "" {
			t.Fatalf("status = %+v", st)
		}
		wantExport := v1alpha1.Export{Name: "vol-a", Port: r.agent.cfg.Port, Addresses: []string{"127.0.0.1"}}
		if st.Export == nil || st.Export.Name != wantExport.Name || st.Export.Port != wantExport.Port || !slices.Equal(st.Export.Addresses, wantExport.Addresses) {
			t.Fatalf("status.export = %+v, want %+v", st.Export, wantExport)
		}
		if cond := meta.FindStatusCondition(st.Conditions, ConditionReady); cond == nil || cond.Status != metav1.ConditionTrue {
			t.Fatalf("Ready condition = %+v", cond)
		}
		if got := fileSize(t, filepath.Join(dir, "vol-a.img")); got != size {
			t.Fatalf("backing file has %d bytes, want %d", got, size)
		}
		if _, ok := r.srv.Export("vol-a"); !ok {
			t.Fatal("no export vol-a on the server")
		}
		r.obs.mu.Lock()
		added := r.obs.exports["vol-a"]
		r.obs.mu.Unlock()
		if !added {
			t.Error("the observer was not told about export vol-a")
		}
	})

	t.Run("no access to Secrets", func(t *testing.T) {
		// The agent runs as its ServiceAccount: any Secret, the
		// publications' included, is out of its reach.
		cl, err := client.New(apiserver.As(cfg, "mpnbd-storage-agent", testNode), client.Options{Scheme: c.Scheme()})
		if err != nil {
			t.Fatal(err)
		}
		for _, ns := range []string{testNamespace, apiserver.DeployNamespace} {
			err := cl.Get(ctx, types.NamespacedName{Namespace: ns, Name: access.SecretName("vol-a", "node-1")}, &corev1.Secret{})
			if !apierrors.IsForbidden(err) {
				t.Errorf("the storage agent reading a Secret in %s: %v, want Forbidden", ns, err)
			}
			if err := cl.List(ctx, &corev1.SecretList{}, client.InNamespace(ns)); !apierrors.IsForbidden(err) {
				t.Errorf("the storage agent listing Secrets in %s: %v, want Forbidden", ns, err)
			}
		}
	})

	t.Run("finalizer added when missing", func(t *testing.T) {
		v := newVolume("vol-b", size)
		v.Finalizers = nil
		if err := c.Create(ctx, v); err != nil {
			t.Fatal(err)
		}
		v = waitObserved(t, c, "vol-b")
		if !controllerutil.ContainsFinalizer(v, v1alpha1.Finalizer) || v.Status.Phase != v1alpha1.VolumeAvailable {
			t.Fatalf("finalizers %v, phase %q", v.Finalizers, v.Status.Phase)
		}
	})

	tokA := publish(t, c, "vol-a", "node-1", false)
	data := bytes.Repeat([]byte("mpnbd-agent!"), 4096/12+1)[:4096]
	var cl1 *nbd.Client
	outer := t // cl1 lives across subtests
	t.Run("publish", func(t *testing.T) {
		cl1 = mustDial(outer, r, access.NodeExport("vol-a", tokA))
		if cl1.Size() != size || cl1.Info().Flags&nbd.FlagReadOnly != 0 {
			t.Fatalf("export info %+v", cl1.Info())
		}
		if _, err := cl1.WriteAt(data, 8192); err != nil {
			t.Fatal(err)
		}
		if err := cl1.Flush(); err != nil {
			t.Fatal(err)
		}
		got := make([]byte, len(data))
		if _, err := cl1.ReadAt(got, 8192); err != nil || !bytes.Equal(got, data) {
			t.Fatalf("read back: %v (equal %v)", err, bytes.Equal(got, data))
		}
	})

	t.Run("refused names", func(t *testing.T) {
		wrong, _ := access.NewToken()
		refused(t, r, "wrong token", access.NodeExport("vol-a", wrong))
		// A token made for node-2, but the volume is not published to it.
		tok2 := must(t, access.NewToken)
		refused(t, r, "unpublished node", access.NodeExport("vol-a", tok2))
		// The hash of a publication is no token.
		refused(t, r, "the hash of a token", access.NodeExport("vol-a", access.TokenHash(tokA)[:32]))
		refused(t, r, "plain volume name", "vol-a")
		refused(t, r, "malformed token", "vol-a/"+tokA[:10])
		refused(t, r, "token of another volume", access.NodeExport("vol-b", tokA))
		refused(t, r, "unknown volume", access.NodeExport("nope", tokA))
		refused(t, r, "volume of another node", access.NodeExport("elsewhere", tokA))
		refused(t, r, "empty name", "")
	})

	t.Run("addresses", func(t *testing.T) {
		tok3 := publish(t, c, "vol-a", "node-3", false, "10.99.0.1", "fd00::1")
		refused(t, r, "connection from an address not published", access.NodeExport("vol-a", tok3))
		tok4 := publish(t, c, "vol-a", "node-4", false, "10.99.0.2", "127.0.0.1")
		mustDial(t, r, access.NodeExport("vol-a", tok4))

		// A publication of a node's token that lists no address grants
		// nothing: the token would be good from any host. One made by an
		// earlier controller (a Secret's token, made so when the node
		// announced no address) keeps its terms. Both are applied with
		// one that lists its address: once that one opens, all three
		// are in force.
		tokAny, tokOld, tokHere := must(t, access.NewToken), must(t, access.NewToken), must(t, access.NewToken)
		err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
			v := getVolume(t, c, "vol-a")
			v.Spec.Publications = append(v.Spec.Publications,
				v1alpha1.Publication{NodeID: "node-any", TokenSHA256: access.TokenHash(tokAny)},
				v1alpha1.Publication{NodeID: "node-old", SecretRef: access.SecretName("vol-a", "node-old"), TokenSHA256: access.TokenHash(tokOld)},
				v1alpha1.Publication{NodeID: "node-here", TokenSHA256: access.TokenHash(tokHere), Addresses: []string{"127.0.0.1"}})
			return c.Update(ctx, v)
		})
		if err != nil {
			t.Fatal(err)
		}
		eventually(t, "the publication with an address in force", func() string {
			cl, err := dial(t, r, access.NodeExport("vol-a", tokHere))
			if err != nil {
				return err.Error()
			}
			cl.Close()
			return ""
		})
		refused(t, r, "a token publication without addresses", access.NodeExport("vol-a", tokAny))
		mustDial(t, r, access.NodeExport("vol-a", tokOld)).Close()
		editVolume(t, c, "vol-a", func(v *v1alpha1.NBDVolume) {
			v.Spec.Publications = slices.DeleteFunc(v.Spec.Publications, func(p v1alpha1.Publication) bool {
				return p.NodeID == "node-any" || p.NodeID == "node-old" || p.NodeID == "node-here"
			})
		})

		// The published addresses are the sources the server keeps
		// handshake slots for, and only while they are published.
		knownSources(t, r, "10.99.0.1", "10.99.0.2", "127.0.0.1", "fd00::1")
		unpublish(t, c, "vol-a", "node-3")
		knownSources(t, r, "10.99.0.2", "127.0.0.1")
	})

	t.Run("token hash not there yet", func(t *testing.T) {
		// As an older controller published: a Secret, no hash. The agent
		// cannot read the Secret; the publication grants nothing until
		// the controller adds the hash, and the others keep theirs.
		secret := access.SecretName("vol-a", "node-6")
		tok := must(t, access.NewToken)
		s := &corev1.Secret{
			ObjectMeta: metav1.ObjectMeta{Name: secret, Namespace: testNamespace},
			Data:       map[string][]byte{access.SecretKeyToken: []byte(tok)},
		}
		if err := c.Create(ctx, s); err != nil {
			t.Fatal(err)
		}
		var gen int64
		err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
			v := getVolume(t, c, "vol-a")
			v.Spec.Publications = append(v.Spec.Publications, v1alpha1.Publication{NodeID: "node-6", SecretRef: secret, Addresses: []string{"127.0.0.1"}})
			if err := c.Update(ctx, v); err != nil {
				return err
			}
			gen = v.Generation
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
		// Long enough for many reconciles: none may report the generation.
		time.Sleep(time.Second)
		if v := getVolume(t, c, "vol-a"); v.Status.ObservedGeneration >= gen {
			t.Fatalf("generation %d reported without the publication's token hash", gen)
		}
		refused(t, r, "a publication without its token hash", access.NodeExport("vol-a", tok))
		mustDial(t, r, access.NodeExport("vol-a", tokA)).Close()
		editVolume(t, c, "vol-a", func(v *v1alpha1.NBDVolume) {
			for i := range v.Spec.Publications {
				if p := &v.Spec.Publications[i]; p.NodeID == "node-6" {
					p.TokenSHA256 = access.TokenHash(tok)
				}
			}
		})
		mustDial(t, r, access.NodeExport("vol-a", tok))
		unpublish(t, c, "vol-a", "node-6")
	})

	t.Run("epochs", func(t *testing.T) {
		// A node keeps its token across publications (it is the node's
		// own); the epoch tells them apart. Published, unpublished (a
		// fenced node, force-detached) and published again: a session
		// of the first publication, still redialing, is refused as
		// superseded, which ends it, and only that refusal is final.
		tok := must(t, access.NewToken)
		publishAt := func(epoch int64) {
			editVolume(t, c, "vol-a", func(v *v1alpha1.NBDVolume) {
				v.Spec.Publications = append(v.Spec.Publications, v1alpha1.Publication{
					NodeID: "node-e", TokenSHA256: access.TokenHash(tok), Addresses: []string{"127.0.0.1"}, Epoch: epoch,
				})
			})
		}
		superseded := func(what, export string) {
			t.Helper()
			cl, err := dial(t, r, export)
			if err == nil {
				cl.Close()
				t.Fatalf("%s: open %q succeeded", what, export)
			}
			if !errors.Is(err, nbd.ErrSuperseded) {
				t.Fatalf("%s: open %q: %v, want a refusal as superseded", what, export, err)
			}
		}
		publishAt(5)
		unpublish(t, c, "vol-a", "node-e")
		publishAt(9)
		superseded("a session from before epochs", access.NodeExport("vol-a", tok))
		superseded("a session of the earlier publication", access.ExportName("vol-a", tok, 5))
		mustDial(t, r, access.ExportName("vol-a", tok, 9)).Close()
		// A newer epoch than the agent applied: the node dials again.
		if cl, err := dial(t, r, access.ExportName("vol-a", tok, 10)); err == nil || errors.Is(err, nbd.ErrSuperseded) || !errors.Is(err, nbd.ErrAccessDenied) {
			if cl != nil {
				cl.Close()
			}
			t.Fatalf("an epoch not applied yet: %v, want a refusal that is not final", err)
		}
		unpublish(t, c, "vol-a", "node-e")
	})

	t.Run("epoch of a withdrawn publication", func(t *testing.T) {
		// As the controller publishes: the epoch is the volume's
		// generation then. The node force-detached (its publication
		// withdrawn, none other to it): its session's redials are refused
		// for good, so that it fails its I/O instead of waiting forever;
		// the epoch of a publication the agent may not have seen yet is
		// refused for now.
		tok := must(t, access.NewToken)
		var epoch int64
		editVolume(t, c, "vol-a", func(v *v1alpha1.NBDVolume) {
			epoch = v.Generation
			v.Spec.Publications = append(v.Spec.Publications, v1alpha1.Publication{
				NodeID: "node-w", TokenSHA256: access.TokenHash(tok), Addresses: []string{"127.0.0.1"}, Epoch: epoch,
			})
		})
		mustDial(t, r, access.ExportName("vol-a", tok, epoch)).Close()
		unpublish(t, c, "vol-a", "node-w")
		cl, err := dial(t, r, access.ExportName("vol-a", tok, epoch))
		if err == nil {
			cl.Close()
			t.Fatal("a session of a withdrawn publication was served")
		}
		if !errors.Is(err, nbd.ErrSuperseded) {
			t.Fatalf("a session of a withdrawn publication: %v, want a refusal as superseded", err)
		}
		next := getVolume(t, c, "vol-a").Generation
		if cl, err := dial(t, r, access.ExportName("vol-a", tok, next)); err == nil || errors.Is(err, nbd.ErrSuperseded) {
			if cl != nil {
				cl.Close()
			}
			t.Fatalf("the epoch of a publication not applied yet: %v, want a refusal that is not final", err)
		}
	})

	t.Run("read-only", func(t *testing.T) {
		tok5 := publish(t, c, "vol-a", "node-5", true)
		cl := mustDial(t, r, access.NodeExport("vol-a", tok5))
		if cl.Info().Flags&nbd.FlagReadOnly == 0 {
			t.Fatalf("read-only publication announced flags %#x", cl.Info().Flags)
		}
		var nerr *nbd.Error
		if _, err := cl.WriteAt(make([]byte, 4096), 8192); !errors.As(err, &nerr) || nerr.Errno != nbd.EPERM {
			t.Fatalf("write on a read-only publication: %v, want EPERM", err)
		}
		got := make([]byte, len(data))
		if _, err := cl.ReadAt(got, 8192); err != nil || !bytes.Equal(got, data) {
			t.Fatalf("read: %v (equal %v)", err, bytes.Equal(got, data))
		}
	})

	t.Run("unpublish closes connections", func(t *testing.T) {
		buf := make([]byte, 4096)
		if _, err := cl1.ReadAt(buf, 0); err != nil {
			t.Fatalf("before unpublishing: %v", err)
		}
		unpublish(t, c, "vol-a", "node-1")
		if _, err := cl1.ReadAt(buf, 0); err == nil {
			t.Fatal("I/O on the connection of an unpublished node succeeded")
		}
		refused(t, r, "token of an unpublished node", access.NodeExport("vol-a", tokA))
	})

	t.Run("grow", func(t *testing.T) {
		const bigger = 3 * size
		v := editVolume(t, c, "vol-a", func(v *v1alpha1.NBDVolume) { v.Spec.SizeBytes = bigger })
		if v.Status.CapacityBytes != bigger || v.Status.Phase != v1alpha1.VolumeAvailable {
			t.Fatalf("status after growing: %+v", v.Status)
		}
		if got := fileSize(t, filepath.Join(dir, "vol-a.img")); got != bigger {
			t.Fatalf("backing file has %d bytes, want %d", got, bigger)
		}
		tok7 := publish(t, c, "vol-a", "node-7", false)
		cl := mustDial(t, r, access.NodeExport("vol-a", tok7))
		if cl.Size() != bigger {
			t.Fatalf("a new connection sees %d bytes, want %d", cl.Size(), bigger)
		}
		if _, err := cl.WriteAt(data, bigger-4096); err != nil {
			t.Fatalf("write at the new end: %v", err)
		}
		// Asking for less never shrinks.
		v = editVolume(t, c, "vol-a", func(v *v1alpha1.NBDVolume) { v.Spec.SizeBytes = size })
		if v.Status.CapacityBytes != bigger || fileSize(t, filepath.Join(dir, "vol-a.img")) != bigger {
			t.Fatalf("a smaller request shrank the volume: %+v", v.Status)
		}
	})

	t.Run("too big", func(t *testing.T) {
		if err := c.Create(ctx, newVolume("vol-huge", 1<<60)); err != nil {
			t.Fatal(err)
		}
		v := waitObserved(t, c, "vol-huge")
		st := v.Status
		if st.Phase != v1alpha1.VolumeFailed || st.Code != "ResourceExhausted" || !strings.Contains(st.Message, fmt.Sprint(int64(1)<<60)) {
			t.Fatalf("status = %+v", st)
		}
		if cond := meta.FindStatusCondition(st.Conditions, ConditionReady); cond == nil || cond.Status != metav1.ConditionFalse {
			t.Fatalf("Ready condition = %+v", cond)
		}
		if _, err := os.Stat(filepath.Join(dir, "vol-huge.img")); !errors.Is(err, os.ErrNotExist) {
			t.Fatalf("backing file of a refused volume: %v", err)
		}
	})

	t.Run("grow too big", func(t *testing.T) {
		// A volume that cannot grow keeps serving its size and still
		// applies its publications: a revoked node loses access.
		if err := c.Create(ctx, newVolume("vol-g", size)); err != nil {
			t.Fatal(err)
		}
		waitObserved(t, c, "vol-g")
		tok := publish(t, c, "vol-g", "node-g", false)
		cl := mustDial(t, r, access.NodeExport("vol-g", tok))
		v := editVolume(t, c, "vol-g", func(v *v1alpha1.NBDVolume) { v.Spec.SizeBytes = 1 << 60 })
		st := v.Status
		if st.Phase != v1alpha1.VolumeAvailable || st.CapacityBytes != size || st.Code != "ResourceExhausted" {
			t.Fatalf("status after a failed grow = %+v", st)
		}
		if cond := meta.FindStatusCondition(st.Conditions, ConditionGrown); cond == nil || cond.Status != metav1.ConditionFalse || cond.Reason != "ResourceExhausted" {
			t.Fatalf("Grown condition = %+v", cond)
		}
		if _, err := cl.ReadAt(make([]byte, 4096), 0); err != nil {
			t.Fatalf("I/O after a failed grow: %v", err)
		}
		unpublish(t, c, "vol-g", "node-g")
		if _, err := cl.ReadAt(make([]byte, 4096), 0); err == nil {
			t.Fatal("an unpublished node keeps access to a volume that could not grow")
		}
		refused(t, r, "token of an unpublished node", access.NodeExport("vol-g", tok))
		// A reachable size clears the failure.
		v = editVolume(t, c, "vol-g", func(v *v1alpha1.NBDVolume) { v.Spec.SizeBytes = 2 * size })
		if v.Status.Code != "" || v.Status.CapacityBytes != 2*size {
			t.Fatalf("status after growing within capacity = %+v", v.Status)
		}
	})

	t.Run("storage node", func(t *testing.T) {
		var before *v1alpha1.NBDStorageNode
		eventually(t, "storage node reported", func() string {
			if before = storageNode(t, c); before == nil {
				return "no NBDStorageNode"
			}
			return ""
		})
		st := before.Status
		if st.CapacityBytes <= 0 || st.AvailableBytes <= 0 || st.AvailableBytes > st.CapacityBytes ||
			st.Port != r.agent.cfg.Port || !slices.Equal(st.Addresses, []string{"127.0.0.1"}) ||
			st.Topology["topology.mpnbd.io/node"] != testNode || st.Heartbeat.IsZero() {
			t.Fatalf("storage node status = %+v", st)
		}
		// The controller's Ready condition outlives the agent's reports.
		marked := before.DeepCopy()
		meta.SetStatusCondition(&marked.Status.Conditions, metav1.Condition{Type: v1alpha1.ConditionReady, Status: metav1.ConditionTrue,
			Reason: v1alpha1.ReasonAgentReporting, Message: "set by the controller"})
		if err := c.Status().Update(ctx, marked); err != nil {
			t.Fatal(err)
		}
		eventually(t, "a report after the condition was set, keeping it", func() string {
			now := storageNode(t, c).Status
			if !now.Heartbeat.After(marked.Status.Heartbeat.Time) {
				return "no report since"
			}
			if meta.FindStatusCondition(now.Conditions, v1alpha1.ConditionReady) == nil {
				t.Fatalf("the agent's report dropped the controller's Ready condition: %+v", now.Conditions)
			}
			return ""
		})
		// The metrics get the numbers of the status (the filesystem's size
		// does not change; what is available may, between two reports).
		if capacity, available, n := r.obs.last(); n == 0 || capacity != st.CapacityBytes || available <= 0 || available > capacity {
			t.Errorf("observer: %d capacity reports, last capacity %d available %d; status capacity %d", n, capacity, available, st.CapacityBytes)
		}
		// A sparse volume takes its whole size from what is available.
		volSize := min(st.AvailableBytes/4, 8<<30) &^ 4095
		const slack = 512 << 20 // other writers on the same filesystem
		if volSize < 4*slack {
			t.Skipf("only %d bytes available on the test filesystem", st.AvailableBytes)
		}
		if err := c.Create(ctx, newVolume("vol-c", volSize)); err != nil {
			t.Fatal(err)
		}
		waitObserved(t, c, "vol-c")
		eventually(t, "available space drops by the volume size", func() string {
			now := storageNode(t, c).Status
			drop := st.AvailableBytes - now.AvailableBytes
			if drop < volSize-slack || drop > volSize+slack {
				return fmt.Sprintf("available %d -> %d (drop %d), volume %d", st.AvailableBytes, now.AvailableBytes, drop, volSize)
			}
			return ""
		})
		deleteWithData(t, c, "vol-c")
		waitGone(t, c, "vol-c")
		if _, err := os.Stat(filepath.Join(dir, "vol-c.img")); !errors.Is(err, os.ErrNotExist) {
			t.Fatalf("backing file of vol-c after DeleteVolume's deletion: %v", err)
		}
	})

	t.Run("orphans", func(t *testing.T) {
		orphan := filepath.Join(dir, "left-behind.img")
		if err := os.WriteFile(orphan, []byte("keep me"), 0o600); err != nil {
			t.Fatal(err)
		}
		waitOrphans(t, c, "left-behind")
		if b, err := os.ReadFile(orphan); err != nil || string(b) != "keep me" {
			t.Fatalf("orphan file: %q, %v", b, err)
		}
	})

	t.Run("delete", func(t *testing.T) {
		tok8 := publish(t, c, "vol-a", "node-8", false)
		cl := mustDial(t, r, access.NodeExport("vol-a", tok8))
		want := make([]byte, 4096)
		for i := range want {
			want[i] = byte(i*7 + 3)
		}
		if _, err := cl.WriteAt(want, 0); err != nil {
			t.Fatal(err)
		}
		if why := r.agent.connected("vol-a"); !strings.Contains(why, "connection(s) to its export still open") {
			t.Fatalf("connections of a served volume: %q", why)
		}
		// Deleted by hand while published: it stays, serves, and says why.
		if err := c.Delete(ctx, getVolume(t, c, "vol-a")); err != nil {
			t.Fatal(err)
		}
		eventually(t, "DeletionBlocked on vol-a", func() string {
			v := getVolume(t, c, "vol-a")
			cond := meta.FindStatusCondition(v.Status.Conditions, ConditionDeletionBlocked)
			if v.DeletionTimestamp.IsZero() || cond == nil || cond.Status != metav1.ConditionTrue || !strings.Contains(cond.Message, "node-8") {
				return fmt.Sprintf("deletion %v, condition %+v", v.DeletionTimestamp, cond)
			}
			return ""
		})
		got := make([]byte, len(want))
		if _, err := cl.ReadAt(got, 0); err != nil || !bytes.Equal(got, want) {
			t.Fatalf("I/O on a volume deleted while published: %v (data equal %v)", err, bytes.Equal(got, want))
		}
		if _, err := os.Stat(filepath.Join(dir, "vol-a.img")); err != nil {
			t.Fatalf("backing file of a volume deleted while published: %v", err)
		}
		// DeleteVolume marks the object someone deleted already; once
		// unpublished it goes, with its data (a deleted volume's status
		// describes no new generation, so no editVolume).
		markDeleteData(t, c, "vol-a")
		if err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
			v := getVolume(t, c, "vol-a")
			v.Spec.Publications = nil
			return c.Update(ctx, v)
		}); err != nil {
			t.Fatal(err)
		}
		waitGone(t, c, "vol-a")
		if _, err := os.Stat(filepath.Join(dir, "vol-a.img")); !errors.Is(err, os.ErrNotExist) {
			t.Fatalf("backing file after delete: %v", err)
		}
		if _, ok := r.srv.Export("vol-a"); ok {
			t.Fatal("export vol-a still served")
		}
		if why := r.agent.connected("vol-a"); why != "" {
			t.Fatalf("connections of a deleted volume: %q", why)
		}
		if _, err := cl.ReadAt(make([]byte, 4096), 0); err == nil {
			t.Fatal("I/O on a deleted volume succeeded")
		}
		refused(t, r, "deleted volume", access.NodeExport("vol-a", tok8))

		// A volume whose file was never made just loses its finalizer,
		// and leaves no orphan.
		if err := c.Delete(ctx, getVolume(t, c, "vol-huge")); err != nil {
			t.Fatal(err)
		}
		waitGone(t, c, "vol-huge")
		waitOrphans(t, c, "left-behind")
	})

	t.Run("deleted by hand keeps the data", func(t *testing.T) {
		if err := c.Create(ctx, newVolume("vol-k", size)); err != nil {
			t.Fatal(err)
		}
		waitObserved(t, c, "vol-k")
		tok := publish(t, c, "vol-k", "node-k", false)
		cl := mustDial(t, r, access.NodeExport("vol-k", tok))
		want := bytes.Repeat([]byte("kept by hand!"), 4096/13+1)[:4096]
		const off = 12288
		if _, err := cl.WriteAt(want, off); err != nil {
			t.Fatal(err)
		}
		if err := cl.Flush(); err != nil {
			t.Fatal(err)
		}
		// Without the annotation: blocked while published, like any
		// deletion, then released with the file kept.
		if err := c.Delete(ctx, getVolume(t, c, "vol-k")); err != nil {
			t.Fatal(err)
		}
		eventually(t, "DeletionBlocked on vol-k", func() string {
			v := getVolume(t, c, "vol-k")
			if cond := meta.FindStatusCondition(v.Status.Conditions, ConditionDeletionBlocked); cond == nil || cond.Status != metav1.ConditionTrue {
				return fmt.Sprintf("condition %+v", cond)
			}
			return ""
		})
		if err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
			v := getVolume(t, c, "vol-k")
			v.Spec.Publications = nil
			return c.Update(ctx, v)
		}); err != nil {
			t.Fatal(err)
		}
		waitGone(t, c, "vol-k")
		path := filepath.Join(dir, "vol-k.img")
		if got := fileSize(t, path); got != size {
			t.Fatalf("kept backing file has %d bytes, want %d", got, size)
		}
		f, err := os.Open(path)
		if err != nil {
			t.Fatal(err)
		}
		got := make([]byte, len(want))
		_, err = f.ReadAt(got, off)
		f.Close()
		if err != nil || !bytes.Equal(got, want) {
			t.Fatalf("data of the kept backing file: %v (equal %v)", err, bytes.Equal(got, want))
		}
		if _, ok := r.srv.Export("vol-k"); ok {
			t.Fatal("export vol-k still served")
		}
		if _, err := cl.ReadAt(make([]byte, 4096), 0); err == nil {
			t.Fatal("I/O on a deleted volume succeeded")
		}
		refused(t, r, "volume deleted by hand", access.NodeExport("vol-k", tok))
		waitOrphans(t, c, "left-behind", "vol-k")

		// Removing the file by hand is what frees it.
		if err := os.Remove(path); err != nil {
			t.Fatal(err)
		}
		waitOrphans(t, c, "left-behind")
	})

	t.Run("restart", func(t *testing.T) {
		tokB := publish(t, c, "vol-b", "node-1", false)
		cl := mustDial(t, r, access.NodeExport("vol-b", tokB))
		if _, err := cl.WriteAt(data, 0); err != nil {
			t.Fatal(err)
		}
		if err := cl.Flush(); err != nil {
			t.Fatal(err)
		}
		cl.Close()
		r.stop()

		r2 := startAgent(t, cfg, dir)
		var cl2 *nbd.Client
		eventually(t, "vol-b served after a restart", func() string {
			var err error
			if cl2, err = dial(t, r2, access.NodeExport("vol-b", tokB)); err != nil {
				return err.Error()
			}
			return ""
		})
		got := make([]byte, len(data))
		if _, err := cl2.ReadAt(got, 0); err != nil || !bytes.Equal(got, data) {
			t.Fatalf("data after a restart: %v (equal %v)", err, bytes.Equal(got, data))
		}
		if cl2.Size() != size {
			t.Fatalf("size after a restart: %d", cl2.Size())
		}
		// The orphan is still reported, and still there.
		waitOrphans(t, c, "left-behind")
		if _, err := os.Stat(filepath.Join(dir, "left-behind.img")); err != nil {
			t.Fatal(err)
		}
		if v := getVolume(t, c, "elsewhere"); len(v.Status.Phase) > 0 || len(v.Finalizers) != 1 {
			t.Fatalf("a volume of another node was touched: %+v", v)
		}
		if _, err := os.Stat(filepath.Join(dir, "elsewhere.img")); !errors.Is(err, os.ErrNotExist) {
			t.Fatalf("a volume of another node got a file: %v", err)
		}
	})
}

func must[T any](t *testing.T, f func() (T, error)) T {
	t.Helper()
	v, err := f()
	if err != nil {
		t.Fatal(err)
	}
	return v
}
