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
	"cmp"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	"k8s.io/client-go/util/retry"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/mpnbd/mpnbd/api/v1alpha1"
	"github.com/mpnbd/mpnbd/internal/testenv/apiserver"
	"github.com/mpnbd/mpnbd/pkg/access"
	"github.com/mpnbd/mpnbd/pkg/attach"
	"github.com/mpnbd/mpnbd/pkg/driver"
	"github.com/mpnbd/mpnbd/pkg/nbd"
	"github.com/mpnbd/mpnbd/pkg/nodeid"
	"github.com/mpnbd/mpnbd/pkg/replica"
)

// TestAgentFailover runs a replicated volume on three storage agents that
// keep their leases, with the controller's Failover watching them, and a
// node's session (attach.OpenSession, as fuse and ublk run it) given
// every replica's addresses, as the publish context gives them. The
// primary's agent stops under the node's writes: the controller records
// the first replica in sync primary (the epoch raised, the old primary
// out of the in-sync set) and moves the volume to it; the node's session
// reaches it and replays what was unanswered, and its writes complete
// with no error. What the node wrote before and after reads back, and
// both remaining copies hold it. The old primary's agent comes back as a
// replica: the new primary rebuilds it whole and it is in sync again,
// its copy the primary's.
func TestAgentFailover(t *testing.T) {
	sc := newStorageCluster(t)
	ctx, c := context.Background(), sc.c
	const s1, s2, s3 = testNode, "storage-2", "storage-3"
	const leaseDuration = 3 * time.Second
	withLease := func(_ *nbd.Server, cfg *Config) {
		cfg.LeaseNamespace, cfg.LeaseDuration = apiserver.DeployNamespace, leaseDuration
	}
	agents := map[string]*running{}
	for _, n := range []string{s1, s2, s3} {
		agents[n] = sc.start(n, withLease)
	}
	for _, n := range []string{s1, s2, s3} {
		eventually(t, "storage node "+n+" holds its lease", func() string {
			var l coordinationv1.Lease
			if err := c.Get(ctx, client.ObjectKey{Namespace: apiserver.DeployNamespace, Name: v1alpha1.StorageLeaseName(n)}, &l); err != nil {
				return err.Error()
			}
			if l.Spec.HolderIdentity == nil || *l.Spec.HolderIdentity != n || l.Spec.RenewTime == nil {
				return fmt.Sprintf("lease %+v", l.Spec)
			}
			return ""
		})
		// The primary dials the replicas where their NBDStorageNodes
		// say they serve.
		sc.waitAddress(n)
	}
	fctx, stopFailover := context.WithCancel(ctx)
	defer stopFailover()
	go driver.NewFailover(driver.FailoverConfig{Client: c, Namespace: apiserver.DeployNamespace,
		Interval: 200 * time.Millisecond, Logger: testLogger(t)}).Run(fctx)

	const size = 8 << 20
	v := newVolume("vf", size)
	v.Labels = map[string]string{v1alpha1.ReplicaLabel(s2): "", v1alpha1.ReplicaLabel(s3): ""}
	v.Spec.Replicas = 3
	v.Spec.ReplicaNodes = []string{s2, s3}
	if err := c.Create(ctx, v); err != nil {
		t.Fatal(err)
	}
	if v := waitObserved(t, c, "vf"); v.Status.Phase != v1alpha1.VolumeAvailable {
		t.Fatalf("vf: %+v", v.Status)
	}
	tok := publish(t, c, "vf", "node-1", false)
	target := attach.Target{VolumeID: "vf", Export: access.NodeExport("vf", tok), Addrs: []string{agents[s1].addr},
		Replicas: []attach.Server{{StorageNode: s2, Addrs: []string{agents[s2].addr}}, {StorageNode: s3, Addrs: []string{agents[s3].addr}}}}
	sess := openSession(t, target)
	defer sess.Close(5 * time.Second)

	w := &nodeWriter{t: t, want: make([]byte, size)}
	write := func(n int) time.Duration { return w.write(sess.Client, n) }
	holds := func(names ...string) string { return sc.holds("vf", w.want, names...) }
	write(64)
	if msg := holds(s1, s2, s3); msg != "" {
		t.Fatal(msg)
	}

	// The primary's agent goes: the writes wait, then complete on s2.
	agents[s1].stop()
	lost := time.Now()
	pause := write(64)
	t.Logf("failover: the longest write took %v (lease %v); all done %v after the loss", pause.Round(time.Millisecond), leaseDuration, time.Since(lost).Round(time.Millisecond))
	v = getVolume(t, c, "vf")
	if r := v.Status.Replication; r == nil || r.Primary != s2 || r.Epoch != 2 || r.PrimaryEpoch != 2 || !slices.Equal(r.InSync, []string{s2, s3}) {
		t.Fatalf("the record after the failover: %+v", r)
	}
	if v.Spec.StorageNode != s2 || !slices.Equal(v.Spec.ReplicaNodes, []string{s3, s1}) {
		t.Fatalf("the spec after the failover: storage node %s, replicas %v", v.Spec.StorageNode, v.Spec.ReplicaNodes)
	}
	if _, ok := v.Labels[v1alpha1.ReplicaLabel(s1)]; !ok {
		t.Errorf("the old primary's replica label is missing: %v", v.Labels)
	}
	got := make([]byte, size)
	if _, err := sess.Client.ReadAt(got, 0); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, w.want) {
		t.Fatal("after the failover the volume does not read back what the node wrote")
	}
	if msg := holds(s2, s3); msg != "" {
		t.Fatal(msg)
	}

	// The old primary comes back, as a replica: rebuilt, in sync.
	agents[s1] = sc.start(s1, withLease)
	eventually(t, "the old primary back in sync", func() string {
		if r := getVolume(t, c, "vf").Status.Replication; !slices.Equal(r.InSync, []string{s1, s2, s3}) {
			return fmt.Sprintf("record %+v", r)
		}
		return ""
	})
	write(16)
	if msg := holds(s1, s2, s3); msg != "" {
		t.Fatal(msg)
	}
	if r := getVolume(t, c, "vf").Status.Replication; r.Primary != s2 || r.PrimaryEpoch != 2 {
		t.Errorf("the record after the old primary's return: %+v", r)
	}
}

// TestAgentReplicaReplaced: the agent of a 2-replica volume's replica
// stops for good; once its lease has lapsed for ReplicaLostAfter the
// controller puts the spare storage node in its place, the primary's
// agent drops the lost node from the in-sync set and serves through a
// Mirror of the new set, which copies the whole volume to the spare; the
// node's writes go on all along, and the spare's copy ends in sync and
// equal to the primary's. The node's session learns of the spare from
// the primary; the primary then stops for good, the spare is promoted
// and the session reaches it, never given it. The node that came back
// replaces the lost primary; a move made by hand follows. The volume's
// deletion then waits for no lost node.
func TestAgentReplicaReplaced(t *testing.T) {
	sc := newStorageCluster(t)
	ctx, c := context.Background(), sc.c
	const s1, s2, s3 = testNode, "storage-2", "storage-3"
	agents := sc.startLeased(driver.FailoverConfig{ReplicaLostAfter: time.Second}, s1, s2, s3)

	const size = 8 << 20
	v := newVolume("vl", size)
	v.Labels = map[string]string{v1alpha1.ReplicaLabel(s2): ""}
	v.Spec.Replicas = 2
	v.Spec.ReplicaNodes = []string{s2}
	if err := c.Create(ctx, v); err != nil {
		t.Fatal(err)
	}
	if v := waitObserved(t, c, "vl"); v.Status.Phase != v1alpha1.VolumeAvailable {
		t.Fatalf("vl: %+v", v.Status)
	}
	tok := publish(t, c, "vl", "node-1", false)
	target := attach.Target{VolumeID: "vl", Export: access.NodeExport("vl", tok), Addrs: []string{agents[s1].addr},
		Replicas: []attach.Server{{StorageNode: s2, Addrs: []string{agents[s2].addr}}}}
	sess := openSession(t, target)
	defer sess.Close(5 * time.Second)
	w := &nodeWriter{t: t, want: make([]byte, size)}
	w.write(sess.Client, 32)
	if msg := sc.holds("vl", w.want, s1, s2); msg != "" {
		t.Fatal(msg)
	}

	// s2's agent goes for good (no write meanwhile: it is still in sync
	// by the record when it is replaced).
	agents[s2].stop()
	eventually(t, "s2's replica replaced by s3", func() string {
		v := getVolume(t, c, "vl")
		if !slices.Equal(v.Spec.ReplicaNodes, []string{s3}) {
			return fmt.Sprintf("replicas %v", v.Spec.ReplicaNodes)
		}
		return ""
	})
	w.write(sess.Client, 32)
	eventually(t, "s3 in sync, s2 out of the record", func() string {
		if r := getVolume(t, c, "vl").Status.Replication; !slices.Equal(r.InSync, []string{s1, s3}) {
			return fmt.Sprintf("record %+v", r)
		}
		return ""
	})
	w.write(sess.Client, 8)
	if msg := sc.holds("vl", w.want, s1, s3); msg != "" {
		t.Fatal(msg)
	}
	v = getVolume(t, c, "vl")
	if slices.Contains(v.Finalizers, v1alpha1.ReplicaFinalizer(s2)) {
		t.Errorf("the lost node's finalizer is still on the volume: %v", v.Finalizers)
	}
	// The node was given s1 and s2; s1 told it of s3 at the handshake
	// after the replacement (its Mirror closed the nodes' connections).
	if !slices.ContainsFunc(sess.Servers(), func(srv attach.Server) bool {
		return srv.StorageNode == s3 && slices.Contains(srv.Addrs, agents[s3].addr)
	}) {
		t.Fatalf("the node's session was not told of s3: it dials %+v", sess.Servers())
	}
	// s1, the primary, goes for good: s3, in sync, is promoted, and the
	// node's session reaches it (it was never given s3) with no error.
	agents[s1].stop()
	w.write(sess.Client, 32)
	eventually(t, "s3 primary, s1 among the replicas", func() string {
		v := getVolume(t, c, "vl")
		if v.Spec.StorageNode != s3 || v.Status.Replication.Primary != s3 {
			return fmt.Sprintf("storage node %s, record %+v", v.Spec.StorageNode, v.Status.Replication)
		}
		return ""
	})
	// s2 back: it replaces s1 (lost), and the whole volume is copied to it.
	agents[s2] = sc.start(s2, withLease)
	eventually(t, "s1's replica replaced by s2, in sync", func() string {
		v := getVolume(t, c, "vl")
		if r := v.Status.Replication; !slices.Equal(v.Spec.ReplicaNodes, []string{s2}) || !slices.Equal(r.InSync, []string{s2, s3}) {
			return fmt.Sprintf("replicas %v, record %+v", v.Spec.ReplicaNodes, r)
		}
		return ""
	})
	w.write(sess.Client, 8)
	if msg := sc.holds("vl", w.want, s3, s2); msg != "" {
		t.Fatal(msg)
	}
	// s1 back, and the replica moved from s2 (alive and in sync) to it,
	// as an administrator's move does: the primary drops s2 from the
	// in-sync set before it serves again, and copies the whole volume
	// over s1's stale copy (its log went with its replacement); s2's
	// agent removes its copy.
	agents[s1] = sc.start(s1, withLease)
	err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		v := getVolume(t, c, "vl")
		v.Spec.ReplicaNodes = []string{s1}
		labelReplicas(v, s1)
		return c.Update(ctx, v)
	})
	if err != nil {
		t.Fatal(err)
	}
	w.write(sess.Client, 8)
	eventually(t, "s1 in sync in s2's place", func() string {
		if r := getVolume(t, c, "vl").Status.Replication; !slices.Equal(r.InSync, []string{s1, s3}) {
			return fmt.Sprintf("record %+v", r)
		}
		return ""
	})
	w.write(sess.Client, 8)
	if msg := sc.holds("vl", w.want, s3, s1); msg != "" {
		t.Fatal(msg)
	}
	sc.waitReleased("vl", s2)

	// Deleted: it goes without a lost node.
	sess.Close(5 * time.Second)
	unpublish(t, c, "vl", "node-1")
	deleteWithData(t, c, "vl")
	waitGone(t, c, "vl")
}

// openSession opens the node's session of target (as fuse and ublk run
// it), dialling again until it serves (bounded).
func openSession(t *testing.T, target attach.Target) *attach.Session {
	t.Helper()
	var sess *attach.Session
	eventually(t, "the node's session opens "+target.VolumeID, func() string {
		octx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		var err error
		if sess, err = attach.OpenSession(octx, attach.SessionConfig{Logger: testLogger(t)}, target, attach.Options{}); err != nil {
			return err.Error()
		}
		return ""
	})
	return sess
}

// TestAgentDrain: the storage node that holds a volume's primary is
// drained while a node writes, for a 2-replica volume and an unreplicated
// one: the controller adds a replica on a spare node, the primary's agent
// copies the volume to it (an unreplicated volume is served through a
// Mirror for the move, the node's session told of the spare), the primary
// is handed to the in-sync copy (a switchover the node's session rides
// through), and the drained node's copy goes, its agent deleting it. The
// node's writes complete with no error all along, and the copies left are
// equal to what it wrote.
func TestAgentDrain(t *testing.T) {
	const s1, s2, s3 = testNode, "storage-2", "storage-3"
	for _, tc := range []struct {
		name     string
		replicas []string
		// after: where the volume ends, its primary first.
		after []string
	}{
		{"replicated", []string{s2}, []string{s2, s3}},
		{"unreplicated", nil, []string{s2}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			sc := newStorageCluster(t)
			ctx, c := context.Background(), sc.c
			agents := sc.startLeased(driver.FailoverConfig{}, s1, s2, s3)
			if tc.replicas == nil {
				// s3 cordoned: the unreplicated volume's one copy goes
				// to s2.
				setNodeSpec(t, c, s3, func(sp *v1alpha1.NBDStorageNodeSpec) { sp.Unschedulable = true })
			}

			const size = 8 << 20
			v := newVolume("vd", size)
			target := attach.Target{VolumeID: "vd", Addrs: []string{agents[s1].addr}}
			if len(tc.replicas) > 0 {
				v.Labels = map[string]string{}
				for _, n := range tc.replicas {
					v.Labels[v1alpha1.ReplicaLabel(n)] = ""
					target.Replicas = append(target.Replicas, attach.Server{StorageNode: n, Addrs: []string{agents[n].addr}})
				}
				v.Spec.Replicas = int32(len(tc.replicas) + 1)
				v.Spec.ReplicaNodes = tc.replicas
			}
			if err := c.Create(ctx, v); err != nil {
				t.Fatal(err)
			}
			if v := waitObserved(t, c, "vd"); v.Status.Phase != v1alpha1.VolumeAvailable {
				t.Fatalf("vd: %+v", v.Status)
			}
			target.Export = access.NodeExport("vd", publish(t, c, "vd", "node-1", false))
			sess := openSession(t, target)
			defer sess.Close(5 * time.Second)
			w := &nodeWriter{t: t, want: make([]byte, size)}
			w.write(sess.Client, 32)

			// Writes go on while s1 drains.
			stop := make(chan struct{})
			wrote := make(chan time.Duration)
			go func() {
				var longest time.Duration
				for {
					select {
					case <-stop:
						wrote <- longest
						return
					default:
					}
					longest = max(longest, w.write(sess.Client, 4))
				}
			}()
			setNodeSpec(t, c, s1, func(sp *v1alpha1.NBDStorageNodeSpec) { sp.Drain = true })
			eventually(t, fmt.Sprintf("s1 drained: vd on %v, in sync", tc.after), func() string {
				v := getVolume(t, c, "vd")
				r := v.Status.Replication
				if v.Spec.StorageNode != tc.after[0] || !slices.Equal(v.Spec.ReplicaNodes, tc.after[1:]) || r == nil || r.Primary != tc.after[0] ||
					!slices.Equal(r.InSync, slices.Sorted(slices.Values(tc.after))) {
					return fmt.Sprintf("on %s, replicas %v, record %+v", v.Spec.StorageNode, v.Spec.ReplicaNodes, r)
				}
				return ""
			})
			sc.waitReleased("vd", s1)
			close(stop)
			var longest time.Duration
			select {
			case longest = <-wrote:
			case <-time.After(time.Minute):
				t.Fatal("the node's write under way has not completed for a minute")
			}
			t.Logf("longest write while s1 drained: %v", longest)
			w.write(sess.Client, 8)
			if msg := sc.holds("vd", w.want, tc.after...); msg != "" {
				t.Fatal(msg)
			}
			sess.Close(5 * time.Second)
			unpublish(t, c, "vd", "node-1")
			deleteWithData(t, c, "vd")
			waitGone(t, c, "vd")
		})
	}
}

// waitReleased waits until node no longer holds volume name: its copy
// removed, its replica label and finalizer gone.
func (sc *storageCluster) waitReleased(name, node string) {
	t := sc.t
	t.Helper()
	eventually(t, node+"'s copy of "+name+" removed, and its label with its finalizer", func() string {
		if _, err := os.Stat(filepath.Join(sc.dirs[node], name+fileSuffix)); !errors.Is(err, os.ErrNotExist) {
			return fmt.Sprintf("%s's copy: %v", node, err)
		}
		v := getVolume(t, sc.c, name)
		if _, ok := v.Labels[v1alpha1.ReplicaLabel(node)]; ok || slices.Contains(v.Finalizers, v1alpha1.ReplicaFinalizer(node)) {
			return fmt.Sprintf("labels %v, finalizers %v", v.Labels, v.Finalizers)
		}
		return ""
	})
}

// setNodeSpec changes storage node name's spec (an administrator's
// cordon or drain).
func setNodeSpec(t *testing.T, c client.Client, name string, change func(*v1alpha1.NBDStorageNodeSpec)) {
	t.Helper()
	err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		var n v1alpha1.NBDStorageNode
		if err := c.Get(context.Background(), client.ObjectKey{Name: name}, &n); err != nil {
			return err
		}
		change(&n.Spec)
		return c.Update(context.Background(), &n)
	})
	if err != nil {
		t.Fatal(err)
	}
}

// TestForwardConnectionsFenced: a primary's forward connections to one
// replica belong to one session, so that a newer connection fences the
// older ones: a forward still on its way on an older connection (a path
// whose packets vanished, retransmitted later, or a Mirror made again)
// never lands after the newer connection's writes.
func TestForwardConnectionsFenced(t *testing.T) {
	sc := newStorageCluster(t)
	ctx, c := context.Background(), sc.c
	const s1, s2 = testNode, "storage-2"
	agents := map[string]*running{s1: sc.start(s1), s2: sc.start(s2)}
	sc.waitAddress(s2)
	const size = 4 << 20
	v := newVolume("vf", size)
	v.Labels = map[string]string{v1alpha1.ReplicaLabel(s2): ""}
	v.Spec.Replicas = 2
	v.Spec.ReplicaNodes = []string{s2}
	if err := c.Create(ctx, v); err != nil {
		t.Fatal(err)
	}
	if v := waitObserved(t, c, "vf"); v.Status.Phase != v1alpha1.VolumeAvailable {
		t.Fatalf("vf: %+v", v.Status)
	}
	rec := getVolume(t, c, "vf").Status.Replication
	// The primary's own Mirror stops (its connections, of the same
	// session, would fence the test's); its agent's dialer stays.
	agents[s1].stop()
	dial := func() *nbd.Client {
		t.Helper()
		dctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		cl, err := agents[s1].agent.dialReplica(dctx, "vf", s2, rec.PrimaryEpoch)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { cl.Close() })
		return cl
	}
	older, newer := dial(), dial()
	fresh, stale := bytes.Repeat([]byte{0xf1}, 4096), bytes.Repeat([]byte{0x5a}, 4096)
	if _, err := newer.WriteAt(fresh, 0); err != nil {
		t.Fatal(err)
	}
	// The older connection's write comes after the newer's: refused or
	// dropped, never applied.
	done := make(chan error, 1)
	go func() { _, err := older.WriteAt(stale, 0); done <- err }()
	select {
	case err := <-done:
		if err == nil {
			t.Error("a write on the older forward connection succeeded after the newer connection wrote")
		}
	case <-time.After(5 * time.Second):
		older.Close()
	}
	if _, err := newer.ReadAt(make([]byte, 4096), 0); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, 4096)
	f, err := os.Open(filepath.Join(sc.dirs[s2], "vf"+fileSuffix))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.ReadAt(got, 0); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, fresh) {
		t.Fatalf("the replica holds %x... at 0, want the newer connection's %x...", got[:4], fresh[:4])
	}
}

// TestAgentUnsettledReconciled: the primary's storage node goes with a
// forward that reached one replica only and was never acknowledged (its
// node went too: nobody replays it). The replica promoted first makes
// the other replica in sync agree with its copy on that chunk before it
// serves, so that no later failover can show the chunk changing back.
func TestAgentUnsettledReconciled(t *testing.T) {
	sc := newStorageCluster(t)
	ctx, c := context.Background(), sc.c
	const s1, s2, s3 = testNode, "storage-2", "storage-3"
	agents := sc.startLeased(driver.FailoverConfig{}, s1, s2, s3)

	const size = 8 << 20
	v := newVolume("vu", size)
	v.Labels = map[string]string{v1alpha1.ReplicaLabel(s2): "", v1alpha1.ReplicaLabel(s3): ""}
	v.Spec.Replicas = 3
	v.Spec.ReplicaNodes = []string{s2, s3}
	if err := c.Create(ctx, v); err != nil {
		t.Fatal(err)
	}
	if v := waitObserved(t, c, "vu"); v.Status.Phase != v1alpha1.VolumeAvailable {
		t.Fatalf("vu: %+v", v.Status)
	}
	tok := publish(t, c, "vu", "node-1", false)
	target := attach.Target{VolumeID: "vu", Export: access.NodeExport("vu", tok), Addrs: []string{agents[s1].addr},
		Replicas: []attach.Server{{StorageNode: s2, Addrs: []string{agents[s2].addr}}, {StorageNode: s3, Addrs: []string{agents[s3].addr}}}}
	sess := openSession(t, target)
	w := &nodeWriter{t: t, want: make([]byte, size)}
	w.write(sess.Client, 32)
	sess.Close(5 * time.Second) // the node goes: nothing is replayed
	eventually(t, "every copy in sync and equal to what the node wrote", func() string {
		if r := getVolume(t, c, "vu").Status.Replication; !slices.Equal(r.InSync, []string{s1, s2, s3}) {
			return fmt.Sprintf("record %+v", r)
		}
		return sc.holds("vu", w.want, s1, s2, s3)
	})
	// The replicas' ledgers know (their connections' first marks spoken
	// for), and hold nothing.
	for _, n := range []string{s2, s3} {
		waitLedgerSettled(t, agents[n], "vu")
	}
	rec := getVolume(t, c, "vu").Status.Replication

	// A forward of s1's reign, to s2 alone, never settled.
	cert := issue(t, sc.ca, nodeid.Storage, s1)
	dctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	fwd, err := nbd.Dial(dctx, nbd.DialOptions{Addr: agents[s2].addr, Export: access.ExportName("vu", "", rec.PrimaryEpoch), MPTCP: true,
		Logger: testLogger(t), TLS: nodeid.ClientTLS(s2, func() (*tls.Certificate, error) { return cert, nil }, sc.rootsOf)})
	cancel()
	if err != nil {
		t.Fatal(err)
	}
	const at = 5 * replica.Chunk
	if _, err := fwd.WriteAt(bytes.Repeat([]byte{0xd7}, 4096), at); err != nil {
		t.Fatal(err)
	}
	fwd.Close()

	// s1 goes: s2 is promoted, and reconciles s3 before it serves.
	agents[s1].stop()
	eventually(t, "s2 primary, s3 in sync", func() string {
		v := getVolume(t, c, "vu")
		r := v.Status.Replication
		if v.Spec.StorageNode != s2 || r.Primary != s2 || !slices.Equal(r.InSync, []string{s2, s3}) {
			return fmt.Sprintf("on %s, record %+v", v.Spec.StorageNode, r)
		}
		if _, ok := agents[s2].srv.Export("vu"); !ok {
			return "not exported on s2 yet"
		}
		return ""
	})
	// s3 never left the in-sync set (it was not copied whole): the only
	// decision since is the promotion.
	if r := getVolume(t, c, "vu").Status.Replication; r.Epoch != rec.Epoch+1 {
		t.Fatalf("the record after the promotion: %+v, want epoch %d (the promotion alone)", r, rec.Epoch+1)
	}
	eventually(t, "s2 and s3 equal", func() string {
		a, err := os.ReadFile(filepath.Join(sc.dirs[s2], "vu"+fileSuffix))
		if err != nil {
			return err.Error()
		}
		b, err := os.ReadFile(filepath.Join(sc.dirs[s3], "vu"+fileSuffix))
		if err != nil {
			return err.Error()
		}
		if !bytes.Equal(a, b) {
			return fmt.Sprintf("s2 holds %x at the unsettled chunk, s3 %x", a[at:at+4], b[at:at+4])
		}
		return ""
	})
}

// withLease gives an agent a lease of 3 s in the driver's namespace.
func withLease(_ *nbd.Server, cfg *Config) {
	cfg.LeaseNamespace, cfg.LeaseDuration = apiserver.DeployNamespace, 3*time.Second
}

// startLeased starts the agents of nodes with leases, waits until each
// reports its address, and runs the controller's Failover (fc, with the
// cluster's client and namespace, checking every 200ms) until the test
// ends.
func (sc *storageCluster) startLeased(fc driver.FailoverConfig, nodes ...string) map[string]*running {
	t := sc.t
	t.Helper()
	agents := map[string]*running{}
	for _, n := range nodes {
		agents[n] = sc.start(n, withLease)
	}
	for _, n := range nodes {
		sc.waitAddress(n)
	}
	fc.Client, fc.Namespace, fc.Interval, fc.Logger = sc.c, apiserver.DeployNamespace, 200*time.Millisecond, testLogger(t)
	fc.StaleAfter = cmp.Or(fc.StaleAfter, time.Minute)
	ctx, stop := context.WithCancel(context.Background())
	t.Cleanup(stop)
	go driver.NewFailover(fc).Run(ctx)
	return agents
}

// waitLedgerSettled waits (bounded) until r's ledger of volume knows
// and holds nothing: every forward its primary sent settled.
func waitLedgerSettled(t *testing.T, r *running, volume string) {
	t.Helper()
	eventually(t, "the replica's ledger knows every forward settled", func() string {
		r.agent.mu.RLock()
		l := r.agent.ledgers[volume]
		r.agent.mu.RUnlock()
		if l == nil {
			return "no ledger"
		}
		if got, known := l.Unsettled(); !known || len(got) > 0 {
			return fmt.Sprintf("unsettled %v (known %v)", got, known)
		}
		return ""
	})
}

// TestAgentReplicaGivenToAServedVolume: an unreplicated volume served and
// written is given a replica (spec.replicaNodes edited by hand, or a move
// of the volume): its first record has only the primary in sync, as the
// new replica's copy lacks what was written, and the replica joins the
// set only once the volume is copied to it.
func TestAgentReplicaGivenToAServedVolume(t *testing.T) {
	sc := newStorageCluster(t)
	ctx, c := context.Background(), sc.c
	const s1, s2 = testNode, "storage-2"
	agents := sc.startLeased(driver.FailoverConfig{}, s1, s2)
	const size = 8 << 20
	if err := c.Create(ctx, newVolume("vg", size)); err != nil {
		t.Fatal(err)
	}
	if v := waitObserved(t, c, "vg"); v.Status.Phase != v1alpha1.VolumeAvailable {
		t.Fatalf("vg: %+v", v.Status)
	}
	tok := publish(t, c, "vg", "node-1", false)
	sess := openSession(t, attach.Target{VolumeID: "vg", Export: access.NodeExport("vg", tok), Addrs: []string{agents[s1].addr}})
	defer sess.Close(5 * time.Second)
	w := &nodeWriter{t: t, want: make([]byte, size)}
	w.write(sess.Client, 32)
	if err := sess.Client.Flush(); err != nil {
		t.Fatal(err)
	}

	err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		v := getVolume(t, c, "vg")
		labelReplicas(v, s2)
		v.Spec.Replicas = 2
		v.Spec.ReplicaNodes = []string{s2}
		return c.Update(ctx, v)
	})
	if err != nil {
		t.Fatal(err)
	}
	inSync := func(what string, nodes ...string) {
		t.Helper()
		eventually(t, what, func() string {
			if r := getVolume(t, c, "vg").Status.Replication; r == nil || !slices.Equal(r.InSync, nodes) {
				return fmt.Sprintf("record %+v", r)
			}
			return ""
		})
	}
	inSync("vg's replica on s2 in sync", s1, s2)
	if msg := sc.holds("vg", w.want, s1, s2); msg != "" {
		t.Fatalf("s2 counted in sync: %s", msg)
	}
	w.write(sess.Client, 8)
	if msg := sc.holds("vg", w.want, s1, s2); msg != "" {
		t.Fatal(msg)
	}

	// Its replica taken away: served alone, s2 leaves the in-sync set
	// before the first write s2 will not have; given back, s2 is copied
	// again before it counts.
	setReplicas := func(nodes ...string) {
		t.Helper()
		err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
			v := getVolume(t, c, "vg")
			v.Spec.Replicas = int32(len(nodes) + 1)
			v.Spec.ReplicaNodes = nodes
			labelReplicas(v, nodes...)
			return c.Update(ctx, v)
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	setReplicas()
	inSync("vg served alone, s2 out of the in-sync set", s1)
	w.write(sess.Client, 16)
	setReplicas(s2)
	inSync("vg's replica on s2 in sync again", s1, s2)
	if msg := sc.holds("vg", w.want, s1, s2); msg != "" {
		t.Fatalf("s2 counted in sync again: %s", msg)
	}
}

// labelReplicas puts on v the labels by which the agents of nodes find
// the replicas they hold. A volume may have no labels left: the
// controller drops a replica's label once its agent released it.
func labelReplicas(v *v1alpha1.NBDVolume, nodes ...string) {
	if v.Labels == nil {
		v.Labels = map[string]string{}
	}
	for _, n := range nodes {
		v.Labels[v1alpha1.ReplicaLabel(n)] = ""
	}
}
