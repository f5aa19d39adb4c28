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
	"context"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/mpnbd/mpnbd/api/v1alpha1"
	"github.com/mpnbd/mpnbd/pkg/access"
	"github.com/mpnbd/mpnbd/pkg/nbd"
	"github.com/mpnbd/mpnbd/pkg/replica"
)

// The primary's side of a replicated volume (docs/replication.md): the
// agent of spec.storageNode serves the nodes through a replica.Mirror
// over its own copy, which forwards every change to the replicas of the
// in-sync set (replica.go is their side) and has the volume's record, by
// a VolumeArbiter, drop a replica that fails before acknowledging what it
// lacks. The record is made here when the volume has none; replicas out
// of the in-sync set are rebuilt by difference while the volume is
// served.

const (
	// rebuildInterval is how often the replicas out of the in-sync set
	// are tried again.
	rebuildInterval = 5 * time.Second
	// refusedForNow bounds how long a forward's dial tries again when
	// the replica refuses it for now (its watch has not seen the record
	// the primary dials with yet): under the forward deadline, so that a
	// replica that keeps refusing is dropped.
	refusedForNow = 2 * time.Second
	// logDirSuffix ends the directory, next to a volume's file, of the
	// logs of what its replicas out of the in-sync set lack.
	logDirSuffix = ".replicas"
)

// replicated is what the primary holds for a replicated volume.
type replicated struct {
	mirror *replica.Mirror
	// nodes are the volume's replicas (spec.replicaNodes, sorted) the
	// Mirror was made for: another set makes another Mirror.
	nodes []string
	// servers are where the volume's replicas serve nodes, this node
	// first: told to the nodes at their handshakes (nbd.InfoServers), so
	// that a node reaches a replica it was not given when that replica
	// takes over.
	servers []nbd.ServerAddrs
	// changed is signalled when the Mirror's replicas change; changes
	// are those changes, in order, for the Events.
	changed chan struct{}
	mu      sync.Mutex
	changes []replica.ReplicaState
	// stop ends the rebuilds and the reports; wg waits for them.
	stop context.CancelFunc
	wg   sync.WaitGroup
}

// replicatedVolume reports whether vol keeps copies on other nodes.
func replicatedVolume(vol *v1alpha1.NBDVolume) bool { return len(vol.Spec.ReplicaNodes) > 0 }

// ensureRecord returns vol's replication record, making it when there is
// none: this node primary since epoch 1, and in sync with it the replicas
// that hold what it holds: all of them for a volume made empty (every
// copy is zeroes) and never served, none for one filled from a content
// source or served before it had replicas (an unreplicated volume given
// some: they are rebuilt whole). Made before the volume is first served
// through a Mirror, so that no change precedes it.
func (a *Agent) ensureRecord(ctx context.Context, log *slog.Logger, vol *v1alpha1.NBDVolume) (*v1alpha1.ReplicationStatus, error) {
	if r := vol.Status.Replication; r != nil {
		return r, nil
	}
	inSync := []string{a.cfg.NodeName}
	if vol.Spec.ContentSource == nil && !servedBefore(vol) {
		inSync = append(inSync, vol.Spec.ReplicaNodes...)
	}
	slices.Sort(inSync)
	orig := vol.DeepCopy()
	vol.Status.Replication = &v1alpha1.ReplicationStatus{Epoch: 1, Primary: a.cfg.NodeName, PrimaryEpoch: 1,
		InSync: inSync, InSyncReplicas: int32(len(inSync))}
	// Optimistic: of two writers of the first record, one wins.
	if err := a.client.Status().Patch(ctx, vol, client.MergeFromWithOptions(orig, client.MergeFromWithOptimisticLock{})); err != nil {
		return nil, fmt.Errorf("making the replication record: %w", err)
	}
	log.Info("replication record made", "in_sync", inSync)
	return vol.Status.Replication, nil
}

// servedBefore reports whether vol has been served (its status says so
// from the first serve on): its copy may hold data.
func servedBefore(vol *v1alpha1.NBDVolume) bool {
	return vol.Status.Export != nil || vol.Status.CapacityBytes > 0
}

// startMirror makes the Mirror that serves vol from v's file, its
// forwards going to the replicas in sync as rec has them, and starts the
// rebuilds of the others.
func (a *Agent) startMirror(log *slog.Logger, vol *v1alpha1.NBDVolume, v *volume, rec *v1alpha1.ReplicationStatus) *failure {
	if a.cfg.PeerTLS == nil {
		return &failure{code: "FailedPrecondition", message: "a replicated volume needs the storage agents' certificates (the storage network's TLS)", retry: exhaustedRetry}
	}
	if err := os.MkdirAll(a.logDir(vol.Name), 0o700); err != nil {
		return internal("the replicas' log directory: %v", err)
	}
	// The log of a node that is no longer a replica (replaced) says
	// nothing of what it would lack were it a replica again.
	entries, err := os.ReadDir(a.logDir(vol.Name))
	if err != nil {
		return internal("the replicas' log directory: %v", err)
	}
	for _, e := range entries {
		if n, ok := strings.CutSuffix(e.Name(), ".dirty"); ok && !slices.Contains(vol.Spec.ReplicaNodes, n) {
			if err := os.Remove(filepath.Join(a.logDir(vol.Name), e.Name())); err != nil {
				return internal("removing the log of %s, no longer a replica: %v", n, err)
			}
			log.Info("the log of a node no longer a replica removed", "replica", n)
		}
	}
	// The replicas in sync agree with this copy on what forwards may
	// have left unsettled before anything is served.
	rctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	rec, err = a.reconcileUnsettled(rctx, log, vol, rec)
	cancel()
	if err != nil {
		return &failure{code: "Unavailable", message: fmt.Sprintf("reconciling the replicas' unsettled chunks: %v", err), retry: time.Second}
	}
	peers := map[string]replica.Peer{}
	var out []string
	for _, n := range vol.Spec.ReplicaNodes {
		if slices.Contains(rec.InSync, n) {
			peers[n] = a.forwardPeer(vol.Name, n, rec.PrimaryEpoch)
		} else {
			out = append(out, n)
		}
	}
	r := &replicated{changed: make(chan struct{}, 1), nodes: slices.Sorted(slices.Values(vol.Spec.ReplicaNodes)),
		servers: a.servers(log, vol)}
	m, err := replica.New(replica.Config{
		Local:   v.backend,
		Peers:   peers,
		Out:     out,
		Epoch:   rec.Epoch,
		Arbiter: &VolumeArbiter{Client: a.client, Reader: a.reader, Volume: vol.Name, Self: a.cfg.NodeName},
		LogDir:  a.logDir(vol.Name),
		Logger:  log,
		OnChange: func(st replica.ReplicaState) {
			r.mu.Lock()
			r.changes = append(r.changes, st)
			r.mu.Unlock()
			select {
			case r.changed <- struct{}{}:
			default:
			}
		},
	})
	if err != nil {
		return internal("replicating: %v", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	r.mirror, r.stop = m, cancel
	// resolve reads it (the nodes' handshakes) under a.mu.
	a.mu.Lock()
	v.replicated = r
	a.mu.Unlock()
	r.wg.Add(2)
	go a.runRebuilds(ctx, log, vol.Name, vol.Spec.ReplicaNodes, rec.PrimaryEpoch, r)
	ref := corev1.ObjectReference{APIVersion: v1alpha1.GroupVersion.String(), Kind: "NBDVolume", Name: vol.Name, UID: vol.UID}
	go a.reportReplicas(ctx, log, ref, r)
	log.Info("serving as the primary", "epoch", rec.Epoch, "primary_epoch", rec.PrimaryEpoch, "in_sync", rec.InSync, "out", out)
	return nil
}

// servers lists where vol's replicas (this node first) serve, as their
// NBDStorageNodes report it. One that reports no address yet is left
// out: the nodes keep the replicas they were given at publication.
func (a *Agent) servers(log *slog.Logger, vol *v1alpha1.NBDVolume) []nbd.ServerAddrs {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var out []nbd.ServerAddrs
	for _, n := range append([]string{a.cfg.NodeName}, vol.Spec.ReplicaNodes...) {
		var sn v1alpha1.NBDStorageNode
		err := a.reader.Get(ctx, types.NamespacedName{Name: n}, &sn)
		if err != nil || len(sn.Status.Addresses) == 0 || sn.Status.Port == 0 {
			log.Info("a replica's addresses are not known: the nodes are not told of it", "replica", n, "error", err)
			continue
		}
		s := nbd.ServerAddrs{Node: n}
		for _, addr := range sn.Status.Addresses {
			s.Addrs = append(s.Addrs, net.JoinHostPort(addr, strconv.Itoa(int(sn.Status.Port))))
		}
		out = append(out, s)
	}
	return out
}

// logDir is where the logs of what volume's replicas lack are kept.
func (a *Agent) logDir(volume string) string {
	return filepath.Join(a.cfg.DataDir, volume+logDirSuffix)
}

// runRebuilds brings the replicas out of the in-sync set back, trying
// each again every rebuildInterval, until ctx ends.
func (a *Agent) runRebuilds(ctx context.Context, log *slog.Logger, volume string, nodes []string, primaryEpoch int64, r *replicated) {
	defer r.wg.Done()
	t := time.NewTicker(rebuildInterval)
	defer t.Stop()
	for {
		for _, n := range nodes {
			if ctx.Err() != nil || r.mirror.Fenced() != nil {
				return
			}
			if r.mirror.Lacking(n) == nil {
				continue
			}
			cl, err := a.dialReplica(ctx, volume, n, primaryEpoch)
			if err != nil {
				log.Info("a replica out of the in-sync set is not reachable yet", "replica", n, "error", err)
				continue
			}
			if err := r.mirror.Rebuild(ctx, n, cl, replica.RebuildOptions{Rate: a.cfg.RebuildRate}); err != nil {
				log.Warn("rebuilding a replica", "replica", n, "error", err)
			}
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// closeReplicated stops v's rebuilds and closes its Mirror (and with it
// the file).
func closeReplicated(r *replicated) error {
	r.stop()
	err := r.mirror.Close()
	r.wg.Wait()
	return err
}

// reportInterval is how often a rebuild's progress is reported while it
// runs.
const reportInterval = 2 * time.Second

// reportReplicas keeps the volume's status.replicas what its Mirror says
// of each replica: at once when one leaves or returns or its rebuild
// starts, and every reportInterval while a rebuild runs. A report that
// fails is tried again at the next.
func (a *Agent) reportReplicas(ctx context.Context, log *slog.Logger, ref corev1.ObjectReference, r *replicated) {
	defer r.wg.Done()
	volume := ref.Name
	t := time.NewTicker(reportInterval)
	defer t.Stop()
	var last []v1alpha1.ReplicaState
	reported, fenced := false, false
	seen := map[string]string{} // each replica's state, as last told
	for _, st := range r.mirror.Replicas() {
		seen[st.Name] = st.State
	}
	for {
		if err := r.mirror.Fenced(); err != nil && !fenced {
			// The nodes' requests wait unanswered on this primary: end
			// their connections, so that they move to the one that
			// replaced it now rather than at their deadline (resolve
			// refuses them here from now on).
			fenced = true
			go a.closeNodeConns(ctx, volume, fmt.Sprintf("fenced: %v", err))
		}
		r.mu.Lock()
		changes := r.changes
		r.changes = nil
		r.mu.Unlock()
		for _, st := range changes {
			if before := seen[st.Name]; before != st.State {
				a.replicaEvent(ctx, log, ref, st, before)
			}
			seen[st.Name] = st.State
		}
		var now []v1alpha1.ReplicaState
		states := r.mirror.Replicas()
		for _, st := range states {
			now = append(now, v1alpha1.ReplicaState{Node: st.Name, State: st.State, LackingBytes: st.Lacking,
				RebuildCopiedBytes: st.Copied, RebuildTotalBytes: st.Total})
		}
		if o, ok := a.cfg.Exports.(ReplicaObserver); ok {
			o.Replicas(volume, states)
		}
		if !reported || !slices.Equal(now, last) {
			b, err := json.Marshal(map[string]any{"status": map[string]any{"replicas": now}})
			if err == nil {
				err = a.client.Status().Patch(ctx, &v1alpha1.NBDVolume{ObjectMeta: metav1.ObjectMeta{Name: volume}},
					client.RawPatch(types.MergePatchType, b))
			}
			if err != nil {
				log.Debug("reporting the replicas", "error", err)
			} else {
				last, reported = now, true
			}
		}
		select {
		case <-ctx.Done():
			return
		case <-r.changed:
		case <-t.C:
		}
	}
}

// dialReplica opens volume's copy on storage node as its primary: over
// the storage network's TLS with this node's storage certificate, named
// with primaryEpoch, on the addresses the node's NBDStorageNode reports.
// A refusal for now (the replica has not seen the record yet) is tried
// again for up to refusedForNow.
func (a *Agent) dialReplica(ctx context.Context, volume, node string, primaryEpoch int64, askInfos ...uint16) (*nbd.Client, error) {
	var sn v1alpha1.NBDStorageNode
	if err := a.reader.Get(ctx, types.NamespacedName{Name: node}, &sn); err != nil {
		return nil, fmt.Errorf("storage node %s: %w", node, err)
	}
	if len(sn.Status.Addresses) == 0 || sn.Status.Port == 0 {
		return nil, fmt.Errorf("storage node %s reports no storage address", node)
	}
	export := access.ExportName(volume, "", primaryEpoch)
	sess := forwardSession(volume, a.cfg.NodeName, node, primaryEpoch)
	end := time.Now().Add(refusedForNow)
	for {
		var errs []error
		for _, addr := range sn.Status.Addresses {
			dctx, cancel := context.WithTimeout(ctx, replica.DefaultDeadline)
			cl, err := nbd.Dial(dctx, nbd.DialOptions{
				Addr:     net.JoinHostPort(addr, strconv.Itoa(int(sn.Status.Port))),
				Export:   export,
				MPTCP:    true,
				TLS:      a.cfg.PeerTLS(node),
				Logger:   a.log,
				Session:  &sess,
				AskInfos: askInfos,
			})
			cancel()
			if err == nil {
				return cl, nil
			}
			if errors.Is(err, nbd.ErrSuperseded) {
				return nil, fmt.Errorf("replica %s of %s: %w", node, volume, err)
			}
			errs = append(errs, err)
			if errors.Is(err, nbd.ErrAccessDenied) {
				break // the replica answered: its other addresses say the same
			}
		}
		err := errors.Join(errs...)
		if !errors.Is(err, nbd.ErrAccessDenied) || time.Now().After(end) {
			return nil, fmt.Errorf("replica %s of %s: %w", node, volume, err)
		}
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// forwardPeer is a replica of the in-sync set as the Mirror forwards to
// it, connected on first use: a replica that cannot be reached fails the
// forward, and the Mirror drops it from the in-sync set.
func (a *Agent) forwardPeer(volume, node string, primaryEpoch int64) *lazyPeer {
	ctx, cancel := context.WithCancel(context.Background())
	return &lazyPeer{ctx: ctx, cancel: cancel, dial: func(ctx context.Context) (*nbd.Client, error) {
		return a.dialReplica(ctx, volume, node, primaryEpoch)
	}}
}

// forwardSession names the session of primary's forward connections to
// replica for volume in primaryEpoch: the same for every connection of
// that primary's reign, in this process and the next, so that a newer
// connection fences the older ones (their forwards still on the way, on
// a path whose packets vanished or from a Mirror made again, never land
// after the newer connection's). Another reign's connections are refused
// by the replica anyway (rule 5).
func forwardSession(volume, primary, replica string, primaryEpoch int64) nbd.SessionID {
	h := sha256.Sum256([]byte(fmt.Sprintf("mpnbd forward\x00%s\x00%s\x00%s\x00%d", volume, primary, replica, primaryEpoch)))
	var id nbd.SessionID
	copy(id[:], h[:])
	return id
}

// lazyPeer is a replica.Peer that dials on its first call.
type lazyPeer struct {
	dial   func(context.Context) (*nbd.Client, error)
	ctx    context.Context
	cancel context.CancelFunc

	mu     sync.Mutex
	cl     *nbd.Client
	err    error // the dial failed: every call fails so
	closed bool
}

// conn returns the connection, dialling it on the first call; a Close
// meanwhile ends the dial.
func (p *lazyPeer) conn() (*nbd.Client, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	switch {
	case p.closed:
		return nil, nbd.ErrClosed
	case p.cl != nil || p.err != nil:
		return p.cl, p.err
	}
	p.cl, p.err = p.dial(p.ctx)
	return p.cl, p.err
}

// errNotDialed: a settle mark does not dial (a replica's address may not
// be known yet at the Mirror's start); the first forward does.
var errNotDialed = errors.New("the replica is not dialled yet")

// Settle sends a settle mark (replica.Settler) once the connection is
// up.
func (p *lazyPeer) Settle(mark uint64, settled uint32) error {
	p.mu.Lock()
	cl, err := p.cl, p.err
	p.mu.Unlock()
	switch {
	case err != nil:
		return err
	case cl == nil:
		return errNotDialed
	}
	return cl.Settle(mark, settled)
}

func (p *lazyPeer) WriteAt(b []byte, off int64) (int, error) {
	cl, err := p.conn()
	if err != nil {
		return 0, err
	}
	return cl.WriteAt(b, off)
}

func (p *lazyPeer) Trim(off, n int64) error {
	cl, err := p.conn()
	if err != nil {
		return err
	}
	return cl.Trim(off, n)
}

func (p *lazyPeer) WriteZeroes(off, n int64, noHole bool) error {
	cl, err := p.conn()
	if err != nil {
		return err
	}
	return cl.WriteZeroes(off, n, noHole)
}

func (p *lazyPeer) Flush() error {
	cl, err := p.conn()
	if err != nil {
		return err
	}
	return cl.Flush()
}

// Close ends a dial under way (it holds mu) and then the connection.
func (p *lazyPeer) Close() error {
	p.cancel()
	p.mu.Lock()
	defer p.mu.Unlock()
	p.closed = true
	if p.cl != nil {
		return p.cl.Close()
	}
	return nil
}

// primaryBackend is the backend that serves replicated vol from this
// node, its primary: the Mirror over v's file, made (with the record, if
// none) when the volume is first served. A record that names another
// primary serves nothing here.
func (a *Agent) primaryBackend(ctx context.Context, log *slog.Logger, vol *v1alpha1.NBDVolume, v *volume) (nbd.Backend, *failure) {
	if v.replicated != nil {
		return v.replicated.mirror, nil
	}
	rec, err := a.ensureRecord(ctx, log, vol)
	switch {
	case apierrors.IsConflict(err):
		return nil, &failure{code: "Aborted", message: err.Error(), retry: 100 * time.Millisecond, passing: true}
	case err != nil:
		return nil, internal("%v", err)
	}
	rec, f := a.recordToServe(ctx, log, vol, rec)
	if f != nil {
		return nil, f
	}
	if f := a.startMirror(log, vol, v, rec); f != nil {
		return nil, f
	}
	return v.replicated.mirror, nil
}

// recordToServe reads vol's record as the API server has it now, not as
// the cache last saw it (a stale in-sync set would forward to a replica
// dropped since as if it had everything, and a stale epoch would have the
// first decision refused and fence a sound primary), rec if it has none.
// It fails (passing) when the record names another node the primary (a
// promotion the controller has recorded and not yet moved the volume
// for); otherwise every node in sync that is no longer one of the
// volume's replicas (the controller replaced it, a drain moved it, or the
// volume has no replicas left) leaves the in-sync set before anything is
// served: it will not have what comes next.
func (a *Agent) recordToServe(ctx context.Context, log *slog.Logger, vol *v1alpha1.NBDVolume, rec *v1alpha1.ReplicationStatus) (*v1alpha1.ReplicationStatus, *failure) {
	var fresh v1alpha1.NBDVolume
	if err := a.reader.Get(ctx, types.NamespacedName{Name: vol.Name}, &fresh); err != nil {
		return nil, internal("reading the replication record: %v", err)
	}
	if fresh.Status.Replication != nil {
		rec = fresh.Status.Replication
	}
	if rec.Primary != a.cfg.NodeName {
		return nil, &failure{code: "Unavailable", message: fmt.Sprintf("the replication record names %s the primary", rec.Primary),
			retry: time.Second, passing: true}
	}
	arbiter := &VolumeArbiter{Client: a.client, Reader: a.reader, Volume: vol.Name, Self: a.cfg.NodeName}
	for _, n := range rec.InSync {
		if n == a.cfg.NodeName || slices.Contains(vol.Spec.ReplicaNodes, n) {
			continue
		}
		epoch, err := arbiter.Drop(ctx, rec.Epoch, n, errors.New("no longer one of the volume's replicas"))
		if err != nil {
			return nil, &failure{code: "Unavailable", message: fmt.Sprintf("dropping %s, no longer a replica, from the in-sync set: %v", n, err),
				retry: time.Second, passing: true}
		}
		log.Warn("a node no longer among the volume's replicas left the in-sync set", "replica", n, "epoch", epoch)
		next := rec.DeepCopy()
		next.Epoch = epoch
		next.InSync = slices.DeleteFunc(next.InSync, func(x string) bool { return x == n })
		next.InSyncReplicas = int32(len(next.InSync))
		rec = next
	}
	return rec, nil
}

// leaveReplicated readies a volume that had replicas and has none now
// (replicaNodes emptied: a drain's last step, or by hand) to be served
// alone: its former replicas leave the in-sync set before the first write
// here, which they will not have, and their logs go: nothing records what
// changes from now on, so were they replicas again they are copied whole.
func (a *Agent) leaveReplicated(ctx context.Context, log *slog.Logger, vol *v1alpha1.NBDVolume) *failure {
	if _, f := a.recordToServe(ctx, log, vol, vol.Status.Replication); f != nil {
		return f
	}
	if err := os.RemoveAll(a.logDir(vol.Name)); err != nil {
		return internal("removing the replicas' logs: %v", err)
	}
	return nil
}

// replicasGrown fails until every replica in sync serves want bytes at
// least: a primary that grew first could send a change past a replica's
// end, which would drop it.
func (a *Agent) replicasGrown(ctx context.Context, vol *v1alpha1.NBDVolume, v *volume, want int64) *failure {
	if v.replicated == nil {
		return nil
	}
	rec := vol.Status.Replication
	for _, n := range v.replicated.mirror.InSync() {
		cl, err := a.dialReplica(ctx, vol.Name, n, rec.PrimaryEpoch)
		if err != nil {
			return &failure{code: "Unavailable", message: fmt.Sprintf("growing to %d bytes waits for replica %s: %v", want, n, err), retry: time.Second}
		}
		size := cl.Size()
		cl.Close()
		if size < want {
			return &failure{code: "Unavailable", message: fmt.Sprintf("growing to %d bytes waits for replica %s (%d bytes)", want, n, size), retry: time.Second}
		}
	}
	return nil
}

// replicaEvent records, on the volume, a replica's move from state
// before to st.State.
func (a *Agent) replicaEvent(ctx context.Context, log *slog.Logger, ref corev1.ObjectReference, st replica.ReplicaState, before string) {
	typ, reason, msg := corev1.EventTypeNormal, "", ""
	switch st.State {
	case "Out":
		if before == "Rebuilding" {
			typ, reason, msg = corev1.EventTypeWarning, "ReplicaRebuildFailed",
				fmt.Sprintf("the rebuild of the replica on %s failed: it stays out of the in-sync set, lacking %d bytes", st.Name, st.Lacking)
		} else {
			typ, reason, msg = corev1.EventTypeWarning, "ReplicaOut",
				fmt.Sprintf("the replica on %s left the in-sync set: writes go on without it; it lacks %d bytes, copied back when it returns", st.Name, st.Lacking)
		}
	case "Rebuilding":
		reason, msg = "ReplicaRebuilding", fmt.Sprintf("rebuilding the replica on %s: copying the %d bytes it lacks", st.Name, st.Lacking)
	case "InSync":
		reason, msg = "ReplicaInSync", fmt.Sprintf("the replica on %s is in sync again", st.Name)
	default:
		return
	}
	now := metav1.Now()
	ev := &corev1.Event{
		ObjectMeta:     metav1.ObjectMeta{GenerateName: ref.Name + ".", Namespace: metav1.NamespaceDefault},
		InvolvedObject: ref,
		Reason:         reason,
		Message:        msg,
		Type:           typ,
		Source:         corev1.EventSource{Component: "mpnbd-storage-agent", Host: a.cfg.NodeName},
		FirstTimestamp: now,
		LastTimestamp:  now,
		Count:          1,
	}
	if err := a.client.Create(ctx, ev); err != nil {
		log.Warn("recording an event failed", "reason", reason, "message", msg, "error", err)
	}
}

// replicasChanged closes the Mirror of vol when its replicas
// (spec.replicaNodes) are no longer those it forwards to (the controller
// replaced one): the next reconcile serves the volume through a Mirror of
// the new set. The nodes' connections end with it; they dial again.
func (a *Agent) replicasChanged(log *slog.Logger, vol *v1alpha1.NBDVolume) bool {
	nodes := slices.Sorted(slices.Values(vol.Spec.ReplicaNodes))
	// Without the storage network's TLS no Mirror can serve it: served
	// alone it stays (startMirror says why when it is next opened).
	if len(nodes) > 0 && a.cfg.PeerTLS != nil && a.closeServedAlone(log, vol.Name, nodes) {
		return true
	}
	return a.closeMirror(log, vol.Name, func(r *replicated) bool { return !slices.Equal(r.nodes, nodes) },
		"the volume's replicas changed: serving it again through a Mirror of the new set", "now", nodes)
}

// closeServedAlone stops serving volume name when it is served without
// a Mirror (it had no replicas) and now has replicas: the volume leaves
// the agent's set and is closed (its nodes' connections end), and the
// next reconcile serves it through a Mirror that copies it to them. It
// reports whether it closed it.
func (a *Agent) closeServedAlone(log *slog.Logger, name string, nodes []string) bool {
	a.mu.Lock()
	v := a.vols[name]
	_, exported := a.srv.Export(name)
	if v == nil || v.asReplica || v.replicated != nil || !exported {
		a.mu.Unlock()
		return false
	}
	delete(a.vols, name)
	a.mu.Unlock()
	log.Warn("the volume was given replicas: serving it again through a Mirror that copies it to them", "replicas", nodes)
	if err := a.closeVolume(v); err != nil {
		log.Warn("closing the volume", "error", err)
	}
	return true
}

// closeMirror stops serving volume name through its Mirror when it has
// one and stale says it must go: the volume leaves the agent's set and is
// closed (its nodes' connections end), and why is logged. It reports
// whether it closed it.
func (a *Agent) closeMirror(log *slog.Logger, name string, stale func(*replicated) bool, why string, args ...any) bool {
	a.mu.Lock()
	v := a.vols[name]
	if v == nil || v.asReplica || v.replicated == nil || !stale(v.replicated) {
		a.mu.Unlock()
		return false
	}
	delete(a.vols, name)
	a.mu.Unlock()
	log.Warn(why, append(args, "was", v.replicated.nodes)...)
	if err := a.closeVolume(v); err != nil {
		log.Warn("closing the volume", "error", err)
	}
	return true
}
