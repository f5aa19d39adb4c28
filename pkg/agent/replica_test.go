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
	"crypto/tls"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/util/retry"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/mpnbd/mpnbd/api/v1alpha1"
	"github.com/mpnbd/mpnbd/pkg/access"
	"github.com/mpnbd/mpnbd/pkg/nbd"
	"github.com/mpnbd/mpnbd/pkg/nodeid"
)

// TestAgentReplica runs the agent of a node that holds replicas of
// volumes whose primary is elsewhere (docs/replication.md), against a
// real API server with the deploy tree's RBAC and admission policy: it
// keeps its finalizer and an empty copy of each; serves the copy to the
// recorded primary's storage certificate alone, at an epoch from the
// record's primaryEpoch to its epoch; keeps the primary's forwards open
// while the primary's own decisions raise the epoch, and closes them the
// moment another primary is recorded, refusing its forwards as
// superseded from then on; and deletes the copy when the volume is
// deleted or the copy moved to another node, its file never taken for an
// orphan meanwhile.
func TestAgentReplica(t *testing.T) {
	sc := newStorageCluster(t)
	ctx, c, ca, rootsOf := context.Background(), sc.c, sc.ca, sc.rootsOf
	r := sc.start(testNode)
	dir := sc.dirs[testNode]

	const primary, third = "storage-2", "storage-3"
	certs := map[string]*tls.Certificate{
		primary:  issue(t, ca, nodeid.Storage, primary),
		third:    issue(t, ca, nodeid.Storage, third),
		"node-1": issue(t, ca, nodeid.Node, "node-1"),
	}
	// open dials export of r as the holder of certs[as].
	open := func(as, export string) (*nbd.Client, error) {
		t.Helper()
		dctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		cert := certs[as]
		cl, err := nbd.Dial(dctx, nbd.DialOptions{Addr: r.addr, Export: export, MPTCP: true, Logger: testLogger(t),
			TLS: nodeid.ClientTLS(testNode, func() (*tls.Certificate, error) { return cert, nil }, rootsOf)})
		if err == nil {
			t.Cleanup(func() { cl.Close() })
		}
		return cl, err
	}
	forward := func(from, vol string, epoch int64) (*nbd.Client, error) {
		return open(from, access.ExportName(vol, "", epoch))
	}
	// refusedAs fails the test when export opens for as.
	refusedAs := func(what, as, export string) error {
		t.Helper()
		cl, err := open(as, export)
		if err == nil {
			cl.Close()
			t.Fatalf("%s: opened", what)
		}
		t.Logf("%s: refused: %v", what, err)
		return err
	}
	// refusedForNow: refused, but not as superseded (final for a
	// primary, which would stop forwarding for good).
	refusedForNow := func(what, as, export string) {
		t.Helper()
		if err := refusedAs(what, as, export); errors.Is(err, nbd.ErrSuperseded) {
			t.Errorf("%s: refused as superseded", what)
		}
	}

	// vol-r: stored on storage-2, its primary; replicas here and on
	// storage-3. The controller labels it for each replica's node.
	const size = 4 << 20
	replicated := func(name string) *v1alpha1.NBDVolume {
		return &v1alpha1.NBDVolume{
			ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{
				v1alpha1.ReplicaLabel(testNode): "", v1alpha1.ReplicaLabel(third): ""}},
			Spec: v1alpha1.NBDVolumeSpec{SizeBytes: size, StorageNode: primary, Replicas: 3,
				ReplicaNodes: []string{testNode, third}, AccessType: v1alpha1.AccessBlock},
		}
	}
	if err := c.Create(ctx, replicated("vol-r")); err != nil {
		t.Fatal(err)
	}
	file := filepath.Join(dir, "vol-r"+fileSuffix)
	eventually(t, "the replica's finalizer and its empty copy", func() string {
		v := getVolume(t, c, "vol-r")
		if !slices.Contains(v.Finalizers, v1alpha1.ReplicaFinalizer(testNode)) {
			return fmt.Sprintf("finalizers %v", v.Finalizers)
		}
		if fi, err := os.Stat(file); err != nil || fi.Size() != size {
			return fmt.Sprintf("copy: %v", err)
		}
		return ""
	})
	// The agent writes nothing else of a volume it holds a replica of.
	if v := getVolume(t, c, "vol-r"); v.Status.Phase != "" || v.Status.Export != nil {
		t.Errorf("the replica's agent wrote the status of vol-r: %+v", v.Status)
	}
	refusedForNow("the primary's forward before any record", primary, access.ExportName("vol-r", "", 1))

	// The record: storage-2 primary since epoch 2, now at 3.
	setRecord := func(name string, rec v1alpha1.ReplicationStatus) {
		t.Helper()
		rec.InSyncReplicas = int32(len(rec.InSync))
		err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
			v := getVolume(t, c, name)
			v.Status.Replication = &rec
			return c.Status().Update(ctx, v)
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	setRecord("vol-r", v1alpha1.ReplicationStatus{Epoch: 3, Primary: primary, PrimaryEpoch: 2, InSync: []string{testNode, primary, third}})
	var fwd *nbd.Client
	eventually(t, "the primary's forward at epoch 3 opens", func() string {
		var err error
		if fwd, err = forward(primary, "vol-r", 3); err != nil {
			return err.Error()
		}
		return ""
	})
	data := bytes.Repeat([]byte("forwarded"), 1024)
	if _, err := fwd.WriteAt(data, 8192); err != nil {
		t.Fatal(err)
	}
	if err := fwd.Flush(); err != nil {
		t.Fatal(err)
	}
	onDisk := func() []byte {
		b, err := os.ReadFile(file)
		if err != nil {
			t.Fatal(err)
		}
		return b[8192 : 8192+len(data)]
	}
	if !bytes.Equal(onDisk(), data) {
		t.Fatal("the forwarded write is not in the replica's file after its FLUSH")
	}
	if cl, err := forward(primary, "vol-r", 2); err != nil {
		t.Errorf("a forward of the primary's own epoch 2: %v", err)
	} else {
		cl.Close()
	}
	if err := refusedAs("a forward of epoch 1, before the primary's", primary, access.ExportName("vol-r", "", 1)); !errors.Is(err, nbd.ErrSuperseded) {
		t.Errorf("want ErrSuperseded, got %v", err)
	}
	if err := refusedAs("a forward of epoch 4, newer than the record", primary, access.ExportName("vol-r", "", 4)); errors.Is(err, nbd.ErrSuperseded) {
		t.Error("a newer epoch than the record was refused as superseded: the primary would give up")
	}
	refusedForNow("another replica's certificate", third, access.ExportName("vol-r", "", 3))
	refusedForNow("a node's certificate, by name", "node-1", "vol-r")
	refusedForNow("a node's certificate with a token", "node-1", access.NodeExport("vol-r", "x"))

	// The primary's own decision (a drop) raises the epoch: its forwards
	// stay open.
	setRecord("vol-r", v1alpha1.ReplicationStatus{Epoch: 4, Primary: primary, PrimaryEpoch: 2, InSync: []string{testNode, primary}})
	eventually(t, "the primary's forward at epoch 4 opens", func() string {
		cl, err := forward(primary, "vol-r", 4)
		if err != nil {
			return err.Error()
		}
		cl.Close()
		return ""
	})
	if _, err := fwd.WriteAt(data, 0); err != nil {
		t.Fatalf("the forward of epoch 3 after the primary's drop at epoch 4: %v", err)
	}

	// Another primary recorded: storage-2's forwards are closed, and
	// refused as superseded.
	setRecord("vol-r", v1alpha1.ReplicationStatus{Epoch: 5, Primary: third, PrimaryEpoch: 5, InSync: []string{testNode, third}})
	eventually(t, "the earlier primary's forward closed", func() string {
		if _, err := fwd.ReadAt(make([]byte, 512), 0); err == nil {
			return "it still reads"
		}
		return ""
	})
	if err := refusedAs("the earlier primary's forward", primary, access.ExportName("vol-r", "", 4)); !errors.Is(err, nbd.ErrSuperseded) {
		t.Errorf("want ErrSuperseded, got %v", err)
	}
	if cl, err := forward(third, "vol-r", 5); err != nil {
		t.Errorf("the new primary's forward: %v", err)
	} else if _, err := cl.ReadAt(make([]byte, len(data)), 8192); err != nil {
		t.Errorf("the new primary reading: %v", err)
	}

	// vol-m: a copy that moves to another node: its file goes, and its
	// finalizer. Meanwhile neither copy is taken for an orphan.
	if err := c.Create(ctx, replicated("vol-m")); err != nil {
		t.Fatal(err)
	}
	fileM := filepath.Join(dir, "vol-m"+fileSuffix)
	eventually(t, "vol-m's copy", func() string {
		if _, err := os.Stat(fileM); err != nil {
			return err.Error()
		}
		return ""
	})
	waitOrphans(t, c)
	err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		v := getVolume(t, c, "vol-m")
		v.Spec.ReplicaNodes = []string{third, "storage-4"}
		return c.Update(ctx, v)
	})
	if err != nil {
		t.Fatal(err)
	}
	eventually(t, "vol-m's copy removed, its finalizer released", func() string {
		if _, err := os.Stat(fileM); err == nil {
			return "the file is still there"
		}
		if v := getVolume(t, c, "vol-m"); slices.Contains(v.Finalizers, v1alpha1.ReplicaFinalizer(testNode)) {
			return fmt.Sprintf("finalizers %v", v.Finalizers)
		}
		return ""
	})

	// vol-r deleted as DeleteVolume does: the copy goes with it, then
	// the object.
	deleteWithData(t, c, "vol-r")
	waitGone(t, c, "vol-r")
	if _, err := os.Stat(file); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("vol-r's copy after its deletion: %v", err)
	}
	waitOrphans(t, c)
	var left v1alpha1.NBDVolumeList
	if err := c.List(ctx, &left, client.HasLabels{v1alpha1.ReplicaLabel(testNode)}); err != nil || len(left.Items) != 1 || left.Items[0].Name != "vol-m" {
		t.Errorf("volumes labelled for this node at the end: %v (%v)", left.Items, err)
	}
}
