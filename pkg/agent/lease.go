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
	"fmt"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/mpnbd/mpnbd/api/v1alpha1"
	"github.com/mpnbd/mpnbd/pkg/nbd"
)

// The storage node's lease (v1alpha1.StorageLeaseName) says the agent is
// alive: the controller fails a replicated volume over from a primary
// whose lease it has not seen renewed for the lease's duration
// (docs/replication.md). The agent renews it every third of that
// duration. A primary whose renewals have failed for two thirds of it
// (the controller may promote another replica soon) stops serving its
// replicated volumes to nodes: it closes their connections and refuses
// new ones until a renewal succeeds again, so that the nodes move to the
// replica the controller promotes rather than wait on a primary that can
// no longer acknowledge their writes.

// DefaultLeaseDuration is Config.LeaseDuration's default.
const DefaultLeaseDuration = 6 * time.Second

// leaseHeld reports whether this agent may serve its replicated volumes
// as their primary: its lease was renewed within two thirds of its
// duration (always, without a lease).
func (a *Agent) leaseHeld() bool {
	if a.cfg.LeaseNamespace == "" {
		return true
	}
	last := a.leaseRenewed.Load()
	return last != 0 && time.Since(time.Unix(0, last)) < a.cfg.LeaseDuration*2/3
}

// runLease renews the storage node's lease until ctx ends, and closes the
// connections of the replicated volumes this node is the primary of when
// the renewals lapse.
func (a *Agent) runLease(ctx context.Context) error {
	every := a.cfg.LeaseDuration / 3
	t := time.NewTicker(every / 2)
	defer t.Stop()
	var lastTry time.Time
	held := false
	for {
		if time.Since(lastTry) >= every {
			lastTry = time.Now()
			rctx, cancel := context.WithTimeout(ctx, every)
			err := a.renewLease(rctx)
			cancel()
			if err == nil {
				a.leaseRenewed.Store(time.Now().UnixNano())
			} else if ctx.Err() == nil {
				a.log.Warn("renewing the storage node's lease failed", "lease", v1alpha1.StorageLeaseName(a.cfg.NodeName), "error", err)
			}
		}
		switch now := a.leaseHeld(); {
		case held && !now:
			a.log.Error("the storage node's lease lapsed: its replicated volumes are not served to nodes until it is renewed (another replica may be promoted meanwhile)")
			a.closeReplicatedConns(ctx, "the storage node's lease lapsed")
		case !held && now:
			a.log.Info("the storage node's lease is held", "lease", v1alpha1.StorageLeaseName(a.cfg.NodeName), "duration", a.cfg.LeaseDuration)
		}
		held = a.leaseHeld()
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
	}
}

// renewLease renews the lease, creating it if it is missing.
func (a *Agent) renewLease(ctx context.Context) error {
	name := v1alpha1.StorageLeaseName(a.cfg.NodeName)
	now := metav1.NowMicro()
	spec := coordinationv1.LeaseSpec{
		HolderIdentity:       ptr.To(a.cfg.NodeName),
		LeaseDurationSeconds: ptr.To(int32((a.cfg.LeaseDuration + time.Second - 1) / time.Second)),
		RenewTime:            &now,
	}
	var l coordinationv1.Lease
	err := a.reader.Get(ctx, client.ObjectKey{Namespace: a.cfg.LeaseNamespace, Name: name}, &l)
	switch {
	case apierrors.IsNotFound(err):
		spec.AcquireTime = &now
		l = coordinationv1.Lease{ObjectMeta: metav1.ObjectMeta{Namespace: a.cfg.LeaseNamespace, Name: name}, Spec: spec}
		if err := a.client.Create(ctx, &l); err != nil {
			return fmt.Errorf("creating lease %s: %w", name, err)
		}
		return nil
	case err != nil:
		return fmt.Errorf("reading lease %s: %w", name, err)
	}
	if l.Spec.HolderIdentity == nil || *l.Spec.HolderIdentity != a.cfg.NodeName || l.Spec.AcquireTime == nil {
		spec.AcquireTime = &now
	} else {
		spec.AcquireTime = l.Spec.AcquireTime
	}
	l.Spec = spec
	if err := a.client.Update(ctx, &l); err != nil {
		return fmt.Errorf("renewing lease %s: %w", name, err)
	}
	return nil
}

// closeReplicatedConns closes the nodes' connections to every replicated
// volume this node serves as the primary (they are refused until it may
// serve them again: resolve), each in the background.
func (a *Agent) closeReplicatedConns(ctx context.Context, why string) {
	a.mu.RLock()
	defer a.mu.RUnlock()
	for name, v := range a.vols {
		if v.replicated != nil {
			go a.closeNodeConns(ctx, name, why)
		}
	}
}

// fencedDrain bounds how long the connections of a volume this node may
// no longer serve have to finish the requests under way before they are
// closed hard (the requests waiting for a replica's answer or the
// arbiter's decision are answered when those come, or never).
const fencedDrain = time.Second

// closeNodeConns ends the nodes' connections to a volume this node may no
// longer serve: they replay what was unanswered on the primary that
// replaces it.
func (a *Agent) closeNodeConns(ctx context.Context, name, why string) {
	dctx, cancel := context.WithTimeout(ctx, fencedDrain)
	defer cancel()
	n, err := a.srv.CloseConns(dctx, name, func(nbd.ConnInfo) bool { return true })
	a.log.Warn("a replicated volume's connections closed", "volume_id", name, "reason", why, "connections_closed", n, "drain_error", err)
}

// servesAsPrimary says why this agent may not serve replicated volume v
// to nodes now (its lease lapsed, or its Mirror was fenced: another
// primary replaced it), or "". Called with a.mu read-locked.
func (a *Agent) servesAsPrimary(v *volume) string {
	if v.replicated == nil {
		return ""
	}
	if !a.leaseHeld() {
		return "this storage node's lease lapsed"
	}
	if err := v.replicated.mirror.Fenced(); err != nil {
		return fmt.Sprintf("this primary was fenced: %v", err)
	}
	return ""
}
