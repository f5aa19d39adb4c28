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
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/client/fake"
	"sigs.k8s.io/controller-runtime/pkg/controller/controllerutil"

	"github.com/mpnbd/mpnbd/api/v1alpha1"
	"github.com/mpnbd/mpnbd/internal/testenv/apiserver"
	"github.com/mpnbd/mpnbd/pkg/nbd"
)

// deletionEnv is an agent on a fake client whose NBD server serves
// exports by name (no Resolve), not started: the test reconciles by hand.
type deletionEnv struct {
	t     *testing.T
	agent *Agent
	srv   *nbd.Server
	c     client.Client
	dir   string
}

func newDeletionEnv(t *testing.T) *deletionEnv {
	t.Helper()
	scheme, err := apiserver.Scheme()
	if err != nil {
		t.Fatal(err)
	}
	c := fake.NewClientBuilder().WithScheme(scheme).WithStatusSubresource(&v1alpha1.NBDVolume{}).Build()
	srv := &nbd.Server{Logger: testLogger(t)}
	dir := t.TempDir()
	a, err := New(Config{NodeName: testNode, DataDir: dir, Addresses: []string{"127.0.0.1"},
		Port: 10809, DrainTimeout: time.Second, Logger: testLogger(t)}, srv, c, c)
	if err != nil {
		t.Fatal(err)
	}
	// The agent's Resolve serves only the volumes it holds: these tests
	// open the exports they add themselves.
	srv.Resolve = nil
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		srv.Shutdown(ctx)
	})
	return &deletionEnv{t: t, agent: a, srv: srv, c: c, dir: dir}
}

// deleted makes a volume with a backing file holding data, and deletes its
// object (kept by the finalizer), with the annotation when withData.
func (e *deletionEnv) deleted(name string, data []byte, withData bool) {
	e.t.Helper()
	ctx := context.Background()
	if err := os.WriteFile(filepath.Join(e.dir, name+fileSuffix), data, 0o600); err != nil {
		e.t.Fatal(err)
	}
	v := newVolume(name, int64(len(data)))
	if withData {
		v.Annotations = map[string]string{v1alpha1.DeleteDataAnnotation: v1alpha1.DeleteDataTrue}
	}
	if err := e.c.Create(ctx, v); err != nil {
		e.t.Fatal(err)
	}
	if err := e.c.Delete(ctx, v); err != nil {
		e.t.Fatal(err)
	}
}

// connect opens a connection to the export name (added here, on a memory
// backend, when the server has none), negotiated and in transmission.
func (e *deletionEnv) connect(name string) net.Conn {
	e.t.Helper()
	if _, ok := e.srv.Export(name); !ok {
		if err := e.srv.AddExport(&nbd.Export{Name: name, Backend: nbd.NewMemBackend(1 << 20)}); err != nil {
			e.t.Fatal(err)
		}
	}
	c1, c2 := net.Pipe()
	go e.srv.ServeConn(c2)
	e.t.Cleanup(func() { c1.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if _, err := nbd.NegotiateConn(ctx, c1, name); err != nil {
		e.t.Fatal(err)
	}
	return c1
}

func (e *deletionEnv) reconcile(name string) ctrl.Result {
	e.t.Helper()
	res, err := e.agent.Reconcile(context.Background(), ctrl.Request{NamespacedName: types.NamespacedName{Name: name}})
	if err != nil {
		e.t.Fatalf("reconcile %s: %v", name, err)
	}
	return res
}

// object returns the volume's object, nil when it is gone.
func (e *deletionEnv) object(name string) *v1alpha1.NBDVolume {
	e.t.Helper()
	var v v1alpha1.NBDVolume
	err := e.c.Get(context.Background(), types.NamespacedName{Name: name}, &v)
	if apierrors.IsNotFound(err) {
		return nil
	}
	if err != nil {
		e.t.Fatal(err)
	}
	return &v
}

// TestDeletionWaitsForConnections: a volume deleted with the annotation
// keeps its backing file while the NBD server still has a connection to
// its export (here one the agent's drain did not see: the export is not
// the agent's), says so in DeletionBlocked, and deletes the file and
// releases the object once the connection is gone.
func TestDeletionWaitsForConnections(t *testing.T) {
	e := newDeletionEnv(t)
	data := bytes.Repeat([]byte{0x5a}, 4096)
	e.deleted("vol-x", data, true)
	conn := e.connect("vol-x")

	for range 2 {
		if res := e.reconcile("vol-x"); res.RequeueAfter != connectionsRetry {
			t.Fatalf("reconcile with a connection open: %+v, want a requeue after %v", res, connectionsRetry)
		}
	}
	if got, err := os.ReadFile(filepath.Join(e.dir, "vol-x"+fileSuffix)); err != nil || !bytes.Equal(got, data) {
		t.Fatalf("backing file while a connection is open: %v (data equal %v)", err, bytes.Equal(got, data))
	}
	v := e.object("vol-x")
	if v == nil || !controllerutil.ContainsFinalizer(v, v1alpha1.Finalizer) {
		t.Fatalf("volume released while a connection is open: %+v", v)
	}
	cond := meta.FindStatusCondition(v.Status.Conditions, ConditionDeletionBlocked)
	if cond == nil || cond.Status != metav1.ConditionTrue || cond.Reason != reasonConnected || cond.Message != "deletion waits until the volume is no longer in use: 1 connection(s) to its export still open" {
		t.Fatalf("DeletionBlocked = %+v", cond)
	}

	conn.Close()
	end := time.Now().Add(5 * time.Second)
	for e.srv.ExportConns("vol-x") > 0 {
		if time.Now().After(end) {
			t.Fatal("the closed connection is still counted after 5s")
		}
		time.Sleep(5 * time.Millisecond)
	}
	if res := e.reconcile("vol-x"); res != (ctrl.Result{}) {
		t.Fatalf("reconcile once the connection is gone: %+v", res)
	}
	if _, err := os.Stat(filepath.Join(e.dir, "vol-x"+fileSuffix)); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("backing file once the connection is gone: %v", err)
	}
	if v := e.object("vol-x"); v != nil {
		t.Fatalf("volume still there: %+v", v)
	}
}

// TestDeletionWithoutAnnotationKeepsData: a volume deleted without the
// annotation is released at once, connection or not, and its backing file
// stays as it was.
func TestDeletionWithoutAnnotationKeepsData(t *testing.T) {
	e := newDeletionEnv(t)
	data := bytes.Repeat([]byte("keep"), 1024)
	e.deleted("vol-y", data, false)
	e.connect("vol-y")
	if res := e.reconcile("vol-y"); res != (ctrl.Result{}) {
		t.Fatalf("reconcile: %+v", res)
	}
	if v := e.object("vol-y"); v != nil {
		t.Fatalf("volume still there: %+v", v)
	}
	if got, err := os.ReadFile(filepath.Join(e.dir, "vol-y"+fileSuffix)); err != nil || !bytes.Equal(got, data) {
		t.Fatalf("backing file of a volume deleted without the annotation: %v (data equal %v)", err, bytes.Equal(got, data))
	}
	// The object gone, the next reconcile only forgets it.
	if res := e.reconcile("vol-y"); res != (ctrl.Result{}) {
		t.Fatalf("reconcile of the gone volume: %+v", res)
	}
	if _, err := os.Stat(filepath.Join(e.dir, "vol-y"+fileSuffix)); err != nil {
		t.Fatalf("backing file after the object went: %v", err)
	}
}
