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
	"slices"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/mpnbd/mpnbd/api/v1alpha1"
	"github.com/mpnbd/mpnbd/pkg/nbd"
	"github.com/mpnbd/mpnbd/pkg/replica"
)

// VolumeArbiter records a replicated volume's decisions in its NBDVolume
// (status.replication), for the primary running on storage node Self: a
// decision is an update of the status made against the resourceVersion
// it was checked on, so of two agents deciding at once one wins and the
// other sees the change. It is replica.Arbiter.
type VolumeArbiter struct {
	// Client writes the decisions, and reads the record unless Reader
	// is set. Either way the read must not come from a cache: a
	// decision is checked against the object as the API server has it
	// now.
	Client client.Client
	Reader client.Reader
	Volume string
	Self   string
}

var _ replica.Arbiter = (*VolumeArbiter)(nil)

// Drop records that storage node name leaves the in-sync set, if the
// record still says epoch with Self the primary and name in sync. Any
// other record means a newer decision came first: nbd.ErrSuperseded. An
// error of the API server's (unreachable, timed out) is returned as is,
// for the caller to try again.
func (a *VolumeArbiter) Drop(ctx context.Context, epoch int64, name string, cause error) (int64, error) {
	return a.decide(ctx, epoch, name, fmt.Sprintf("drop (%v)", cause), func(v *v1alpha1.NBDVolume, r *v1alpha1.ReplicationStatus) error {
		if name == a.Self || !slices.Contains(r.InSync, name) {
			return fmt.Errorf("volume %s: %s cannot leave the in-sync set %v: %w", a.Volume, name, r.InSync, nbd.ErrSuperseded)
		}
		r.InSync = slices.DeleteFunc(r.InSync, func(n string) bool { return n == name })
		return nil
	})
}

// decide reads the record, checks that it says epoch with Self the
// primary, lets change make the decision on a copy (its error wrapping
// nbd.ErrSuperseded refuses it), and writes it with the epoch raised,
// conditionally on the resourceVersion read: a change made meanwhile
// fails the write with a conflict, and the record is read and checked
// again.
func (a *VolumeArbiter) decide(ctx context.Context, epoch int64, name, what string, change func(*v1alpha1.NBDVolume, *v1alpha1.ReplicationStatus) error) (int64, error) {
	for {
		var v v1alpha1.NBDVolume
		reader := client.Reader(a.Client)
		if a.Reader != nil {
			reader = a.Reader
		}
		if err := reader.Get(ctx, types.NamespacedName{Name: a.Volume}, &v); err != nil {
			if apierrors.IsNotFound(err) {
				return 0, fmt.Errorf("volume %s is gone: %w", a.Volume, nbd.ErrSuperseded)
			}
			return 0, fmt.Errorf("reading volume %s: %w", a.Volume, err)
		}
		r := v.Status.Replication
		switch {
		case r == nil:
			return 0, fmt.Errorf("volume %s has no replication record: %w", a.Volume, nbd.ErrSuperseded)
		case r.Epoch != epoch || r.Primary != a.Self:
			return 0, fmt.Errorf("volume %s is at epoch %d with primary %s, not %d with %s: %w",
				a.Volume, r.Epoch, r.Primary, epoch, a.Self, nbd.ErrSuperseded)
		}
		next := r.DeepCopy()
		if err := change(&v, next); err != nil {
			return 0, err
		}
		next.Epoch++
		next.InSyncReplicas = int32(len(next.InSync))
		v.Status.Replication = next
		err := a.Client.Status().Update(ctx, &v)
		switch {
		case err == nil:
			return next.Epoch, nil
		case apierrors.IsConflict(err):
			continue
		case apierrors.IsNotFound(err):
			return 0, fmt.Errorf("volume %s is gone: %w", a.Volume, nbd.ErrSuperseded)
		default:
			return 0, fmt.Errorf("recording the %s of %s in volume %s: %w", what, name, a.Volume, err)
		}
	}
}

// Rejoin records that storage node name, rebuilt, is in the in-sync set
// again, if the record still says epoch with Self the primary, name one of
// the volume's replicas and out of the set. Errors are Drop's.
func (a *VolumeArbiter) Rejoin(ctx context.Context, epoch int64, name string) (int64, error) {
	return a.decide(ctx, epoch, name, "rejoin", func(v *v1alpha1.NBDVolume, r *v1alpha1.ReplicationStatus) error {
		if slices.Contains(r.InSync, name) || (name != v.Spec.StorageNode && !slices.Contains(v.Spec.ReplicaNodes, name)) {
			return fmt.Errorf("volume %s: %s cannot rejoin the in-sync set %v (replicas %s, %v): %w",
				a.Volume, name, r.InSync, v.Spec.StorageNode, v.Spec.ReplicaNodes, nbd.ErrSuperseded)
		}
		r.InSync = append(r.InSync, name)
		slices.Sort(r.InSync)
		return nil
	})
}
