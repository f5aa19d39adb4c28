package nbddev

import (
	"context"
	"errors"
	"fmt"

	"github.com/mpnbd/mpnbd/pkg/attach"
	"github.com/mpnbd/mpnbd/pkg/relay"
)

// drainRelay readies a relay's volume for its disconnect: the relay
// pauses (takes nothing more from the kernel, answers what it took, and
// flushes every write it acknowledged, through an outage and a new
// incarnation of the storage node if need be), so that nothing of the
// volume exists only in the relay it ends. Without that, the writes the
// relay retains would go with it, lost for good should the storage node
// have lost its cache. If ctx ends first the relay serves on and the
// error wraps attach.ErrUnflushed. resume undoes the pause (for a
// disconnect that fails). Without a relay there is nothing to drain.
func (a *Attacher) drainRelay(ctx context.Context, v *volume) (resume func(), err error) {
	v.mu.Lock()
	r := v.relay
	v.mu.Unlock()
	if r == nil {
		return func() {}, nil
	}
	_, err = r.Pause(ctx)
	switch {
	case err == nil:
		return r.Resume, nil
	case errors.Is(err, relay.ErrFlushFailureOwed):
		// Every write it retained is flushed; a failed FLUSH before that
		// was never heard by the kernel, and no one is left to hear it
		// but the log.
		a.log.Error("detaching a volume whose storage node failed a flush the kernel was not told of: acknowledged writes may be lost",
			"volume_id", v.target.VolumeID, "nbd_index", v.index)
		return func() {}, nil
	case ctx.Err() != nil:
		st := r.Stats()
		return nil, fmt.Errorf("%w: nbd%d of %s: %d writes (%d bytes) acknowledged and not yet flushed, %d requests unanswered (%v)",
			attach.ErrUnflushed, v.index, v.target.VolumeID, st.Retained, st.RetainedBytes, st.InFlight, ctx.Err())
	default:
		// A relay that ended: what it retained is gone already.
		a.log.Warn("detach: the relay does not pause", "volume_id", v.target.VolumeID, "nbd_index", v.index, "error", err)
		return func() {}, nil
	}
}
