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
	// Client reads without a cache: a decision is checked against the
	// object as the API server has it now.
	Client client.Client
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
	for {
		var v v1alpha1.NBDVolume
		if err := a.Client.Get(ctx, types.NamespacedName{Name: a.Volume}, &v); err != nil {
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
		case name == a.Self || !slices.Contains(r.InSync, name):
			return 0, fmt.Errorf("volume %s: %s cannot leave the in-sync set %v: %w", a.Volume, name, r.InSync, nbd.ErrSuperseded)
		}
		next := r.DeepCopy()
		next.Epoch++
		next.InSync = slices.DeleteFunc(next.InSync, func(n string) bool { return n == name })
		next.InSyncReplicas = int32(len(next.InSync))
		v.Status.Replication = next
		// The update carries the resourceVersion read above: a change
		// made since then fails it with a conflict, and the record is
		// checked again.
		err := a.Client.Status().Update(ctx, &v)
		switch {
		case err == nil:
			return next.Epoch, nil
		case apierrors.IsConflict(err):
			continue
		case apierrors.IsNotFound(err):
			return 0, fmt.Errorf("volume %s is gone: %w", a.Volume, nbd.ErrSuperseded)
		default:
			return 0, fmt.Errorf("recording that %s left the in-sync set of volume %s (%v): %w", name, a.Volume, cause, err)
		}
	}
}
