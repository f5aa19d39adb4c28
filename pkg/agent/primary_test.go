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
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/util/retry"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/mpnbd/mpnbd/api/v1alpha1"
	"github.com/mpnbd/mpnbd/internal/testenv/apiserver"
	"github.com/mpnbd/mpnbd/pkg/access"
	"github.com/mpnbd/mpnbd/pkg/mptcp"
	"github.com/mpnbd/mpnbd/pkg/nbd"
	"github.com/mpnbd/mpnbd/pkg/nodeid"
)

// storageCluster is a real API server (with the driver's namespace) and
// the storage agents of it, each with its storage certificate of one CA,
// serving on loopback over the storage network's TLS.
type storageCluster struct {
	t     *testing.T
	cfg   *rest.Config
	c     client.Client
	ca    *nodeid.CA
	roots *x509.CertPool
	dirs  map[string]string
}

func newStorageCluster(t *testing.T) *storageCluster {
	t.Helper()
	cfg, c := apiserver.Start(t)
	if err := c.Create(context.Background(), &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: testNamespace}}); err != nil {
		t.Fatal(err)
	}
	ca, err := nodeid.NewCA(time.Now())
	if err != nil {
		t.Fatal(err)
	}
	sc := &storageCluster{t: t, cfg: cfg, c: c, ca: ca, roots: x509.NewCertPool(), dirs: map[string]string{}}
	sc.roots.AddCert(ca.Cert)
	return sc
}

// rootsOf is the CA's pool, as Config.NodeRoots and the TLS
// configurations take it.
func (sc *storageCluster) rootsOf() *x509.CertPool { return sc.roots }

// start runs the agent of storage node name over its data directory (the
// same one each time it is started).
func (sc *storageCluster) start(name string, with ...func(*nbd.Server, *Config)) *running {
	t := sc.t
	t.Helper()
	if sc.dirs[name] == "" {
		sc.dirs[name] = t.TempDir()
	}
	cert := issue(t, sc.ca, nodeid.Storage, name)
	certOf := func() (*tls.Certificate, error) { return cert, nil }
	l, err := mptcp.Listen(context.Background(), "tcp", "127.0.0.1:0", true)
	if err != nil {
		t.Fatal(err)
	}
	return startAgentOn(t, sc.cfg, sc.dirs[name], l, "127.0.0.1", append([]func(*nbd.Server, *Config){func(srv *nbd.Server, c *Config) {
		c.NodeName = name
		srv.TLSConfig = nodeid.ServerTLS(certOf, sc.rootsOf)
		c.NodeRoots = sc.rootsOf
		c.PeerTLS = func(node string) *tls.Config { return nodeid.ClientTLS(node, certOf, sc.rootsOf) }
	}}, with...)...)
}

// TestAgentReplicatedVolume runs a replicated volume on three storage
// agents of a real API server, as the controller places it: the primary's
// agent makes the record (all three in sync), serves the node through its
// Mirror and forwards every write to the two replicas' agents, so that
// after a FLUSH the three files hold what the node wrote. One replica's
// agent stops: the primary drops it by the record (the deploy tree's
// admission policy allowing it) and the node's writes go on; the agent
// comes back over its file: the primary rebuilds it by difference and
// the record has it in sync again, its file the primary's. Deleted, the
// volume takes its three files with it.
func TestAgentReplicatedVolume(t *testing.T) {
	sc := newStorageCluster(t)
	ctx, c := context.Background(), sc.c
	const s1, s2, s3 = testNode, "storage-2", "storage-3"
	agents := map[string]*running{s1: sc.start(s1), s2: sc.start(s2), s3: sc.start(s3)}
	for _, n := range []string{s2, s3} {
		sc.waitAddress(n)
	}

	const size = 8 << 20
	v := newVolume("vr", size)
	v.Labels = map[string]string{v1alpha1.ReplicaLabel(s2): "", v1alpha1.ReplicaLabel(s3): ""}
	v.Spec.Replicas = 3
	v.Spec.ReplicaNodes = []string{s2, s3}
	if err := c.Create(ctx, v); err != nil {
		t.Fatal(err)
	}
	record := func() *v1alpha1.ReplicationStatus { return getVolume(t, c, "vr").Status.Replication }
	if v := waitObserved(t, c, "vr"); v.Status.Phase != v1alpha1.VolumeAvailable {
		t.Fatalf("vr: %+v", v.Status)
	}
	if r := record(); r == nil || r.Epoch != 1 || r.Primary != s1 || r.PrimaryEpoch != 1 || !slices.Equal(r.InSync, []string{s1, s2, s3}) {
		t.Fatalf("the record the primary made: %+v", r)
	}
	tok := publish(t, c, "vr", "node-1", false)
	var node *nbd.Client
	eventually(t, "the node opens vr on its primary", func() string {
		var err error
		if node, err = dial(t, agents[s1], access.NodeExport("vr", tok)); err != nil {
			return err.Error()
		}
		return ""
	})

	// What the node wrote: random blocks here and there, then a FLUSH.
	w := &nodeWriter{t: t, want: make([]byte, size)}
	write := func(n int) { w.write(node, n) }
	holds := func(names ...string) string { return sc.holds("vr", w.want, names...) }
	write(64)
	if msg := holds(s1, s2, s3); msg != "" {
		t.Fatal(msg)
	}
	// The primary's settle marks reach the replicas' ledgers: every
	// write settled, they hold nothing.
	for _, n := range []string{s2, s3} {
		waitLedgerSettled(t, agents[n], "vr")
	}

	// s3's agent stops: the next writes drop it, by the record.
	agents[s3].stop()
	write(32)
	if r := record(); r.Epoch != 2 || r.Primary != s1 || !slices.Equal(r.InSync, []string{s1, s2}) {
		t.Fatalf("the record after s3 stopped: %+v", r)
	}
	if msg := holds(s1, s2); msg != "" {
		t.Fatal(msg)
	}
	if msg := holds(s3); msg == "" {
		t.Fatal("s3's file holds writes made after it stopped")
	}
	// The primary reports where each replica stands.
	replicas := func(want ...string) func() string {
		return func() string {
			got := getVolume(t, c, "vr").Status.Replicas
			var states []string
			for _, r := range got {
				st := r.Node + ":" + r.State
				if r.State == "Out" && r.LackingBytes == 0 {
					st += "(lacking nothing?)"
				}
				states = append(states, st)
			}
			if !slices.Equal(states, want) {
				return fmt.Sprintf("status.replicas %+v", got)
			}
			return ""
		}
	}
	eventually(t, "s3 reported out", replicas(s2+":InSync", s3+":Out"))

	// Back over its file: rebuilt by difference, in sync again.
	agents[s3] = sc.start(s3)
	eventually(t, "s3 back in sync", func() string {
		if r := record(); !slices.Equal(r.InSync, []string{s1, s2, s3}) {
			return fmt.Sprintf("record %+v", r)
		}
		return ""
	})
	if r := record(); r.Epoch != 3 || r.PrimaryEpoch != 1 {
		t.Errorf("the record after the rebuild: %+v", r)
	}
	eventually(t, "s3 reported in sync", replicas(s2+":InSync", s3+":InSync"))
	// And the Events on the volume tell the story.
	eventually(t, "Events of s3's leaving, rebuild and return", func() string {
		var evs corev1.EventList
		if err := c.List(ctx, &evs, client.InNamespace(metav1.NamespaceDefault)); err != nil {
			return err.Error()
		}
		var reasons []string
		for _, e := range evs.Items {
			if e.InvolvedObject.Kind == "NBDVolume" && e.InvolvedObject.Name == "vr" && strings.Contains(e.Message, s3) {
				reasons = append(reasons, e.Reason)
			}
		}
		slices.Sort(reasons)
		if !slices.Equal(reasons, []string{"ReplicaInSync", "ReplicaOut", "ReplicaRebuilding"}) {
			return fmt.Sprintf("reasons %v", reasons)
		}
		return ""
	})
	write(16)
	if msg := holds(s1, s2, s3); msg != "" {
		t.Fatal(msg)
	}
	if _, err := os.Stat(filepath.Join(sc.dirs[s1], "vr"+logDirSuffix, s3+".dirty")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("s3's log after its rebuild: %v", err)
	}

	// Grown: every copy grows, the primary's last; a write past the old
	// end reaches all three, and nobody is dropped for it.
	const grown = 2 * size
	v = editVolume(t, c, "vr", func(v *v1alpha1.NBDVolume) { v.Spec.SizeBytes = grown })
	if v.Status.CapacityBytes != grown {
		t.Fatalf("vr after growing: %+v", v.Status)
	}
	for n, dir := range sc.dirs {
		if got := fileSize(t, filepath.Join(dir, "vr"+fileSuffix)); got != grown {
			t.Errorf("%s's copy is %d bytes after growing, want %d", n, got, grown)
		}
	}
	node.Close()
	eventually(t, "the node opens vr again, grown", func() string {
		var err error
		if node, err = dial(t, agents[s1], access.NodeExport("vr", tok)); err != nil {
			return err.Error()
		}
		if node.Size() != grown {
			return fmt.Sprintf("size %d", node.Size())
		}
		return ""
	})
	w.want = append(w.want, make([]byte, grown-size)...)
	tail := bytes.Repeat([]byte("grown"), 4096/5+1)[:4096]
	if _, err := node.WriteAt(tail, grown-4096); err != nil {
		t.Fatalf("writing past the old end: %v", err)
	}
	if err := node.Flush(); err != nil {
		t.Fatal(err)
	}
	copy(w.want[grown-4096:], tail)
	if msg := holds(s1, s2, s3); msg != "" {
		t.Fatal(msg)
	}
	if r := record(); !slices.Equal(r.InSync, []string{s1, s2, s3}) {
		t.Errorf("the record after growing: %+v", r)
	}

	// Another primary recorded (a promotion): this one stops serving the
	// node at once, and the replicas refuse what it would forward.
	err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		v := getVolume(t, c, "vr")
		v.Status.Replication = &v1alpha1.ReplicationStatus{Epoch: 4, Primary: s2, PrimaryEpoch: 4, InSync: []string{s2, s3}, InSyncReplicas: 2}
		return c.Status().Update(ctx, v)
	})
	if err != nil {
		t.Fatal(err)
	}
	eventually(t, "the earlier primary stops serving the node", func() string {
		if _, err := node.ReadAt(make([]byte, 4096), 0); err == nil {
			return "the node still reads"
		}
		return ""
	})
	if cl, err := dial(t, agents[s1], access.NodeExport("vr", tok)); err == nil {
		cl.Close()
		t.Error("the earlier primary still serves the node")
	}

	// Deleted as DeleteVolume does: every copy goes. (Not waiting for
	// the unpublication to be observed: the agent of s1 serves vr no
	// more and reports nothing of it, as the record names s2 primary.)
	node.Close()
	err = retry.RetryOnConflict(retry.DefaultRetry, func() error {
		v := getVolume(t, c, "vr")
		v.Spec.Publications = nil
		return c.Update(ctx, v)
	})
	if err != nil {
		t.Fatal(err)
	}
	deleteWithData(t, c, "vr")
	waitGone(t, c, "vr")
	for n, dir := range sc.dirs {
		if _, err := os.Stat(filepath.Join(dir, "vr"+fileSuffix)); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("%s's copy after the deletion: %v", n, err)
		}
	}
}

// nodeWriter writes random 16 KiB blocks, at 64 KiB steps over the
// volume, as a node does, and keeps what the volume must hold.
type nodeWriter struct {
	t    *testing.T
	want []byte
	seq  int
}

// write writes n blocks through cl, each bounded by the deadline, then a
// FLUSH, and returns the longest a write took.
func (w *nodeWriter) write(cl *nbd.Client, n int) time.Duration {
	t := w.t
	t.Helper()
	var longest time.Duration
	for range n {
		off := int64((w.seq*7919)%(len(w.want)/65536)) * 65536
		w.seq++
		b := make([]byte, 16384)
		rand.Read(b)
		start := time.Now()
		done := make(chan error, 1)
		go func() { _, err := cl.WriteAt(b, off); done <- err }()
		select {
		case err := <-done:
			if err != nil {
				t.Fatalf("the node's write at %d: %v", off, err)
			}
		case <-time.After(deadline):
			t.Fatalf("the node's write at %d unanswered after %v", off, deadline)
		}
		longest = max(longest, time.Since(start))
		copy(w.want[off:], b)
	}
	if err := cl.Flush(); err != nil {
		t.Fatalf("the node's FLUSH: %v", err)
	}
	return longest
}

// holds says which of the storage nodes' copies of volume differs from
// want ("" when none does).
func (sc *storageCluster) holds(volume string, want []byte, names ...string) string {
	for _, n := range names {
		b, err := os.ReadFile(filepath.Join(sc.dirs[n], volume+fileSuffix))
		if err != nil {
			return err.Error()
		}
		if !bytes.Equal(b, want) {
			return n + "'s file differs from what the node wrote"
		}
	}
	return ""
}

// waitAddress waits until storage node n reports where it serves.
func (sc *storageCluster) waitAddress(n string) {
	sc.t.Helper()
	eventually(sc.t, "storage node "+n+" reports its address", func() string {
		var sn v1alpha1.NBDStorageNode
		if err := sc.c.Get(context.Background(), client.ObjectKey{Name: n}, &sn); err != nil {
			return err.Error()
		}
		if sn.Status.Port == 0 {
			return "no port yet"
		}
		return ""
	})
}
