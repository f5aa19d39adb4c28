package agent

import (
	"context"
	"errors"
	"fmt"

	"github.com/mpnbd/mpnbd/pkg/mptcp"
)

// runEndpoints keeps an MPTCP "signal" endpoint on every address of the
// configured storage NICs while the agent runs, so clients join a subflow
// to each. Only those endpoints are touched.
func (a *Agent) runEndpoints(ctx context.Context) error {
	pm, err := mptcp.DialPM()
	if err != nil {
		return fmt.Errorf("agent: MPTCP path manager: %w", err)
	}
	defer pm.Close()
	addrs, err := mptcp.DialAddrs()
	if err != nil {
		return fmt.Errorf("agent: MPTCP endpoints: %w", err)
	}
	defer addrs.Close()
	changes, err := mptcp.AddrChanges(ctx)
	if err != nil {
		// Periodic runs still catch address changes, only later.
		a.log.Warn("no address change notifications; endpoints follow changes at the next periodic run", "error", err)
		changes = nil
	}
	log := a.log.With("nics", a.cfg.SignalNICs)
	// Port 0: the endpoints announce the port each connection uses, the
	// NBD server's, which already listens on every address.
	d := mptcp.Desired{NICs: a.cfg.SignalNICs, Role: mptcp.RoleServer}
	err = mptcp.Watch(ctx, pm, addrs, d, mptcp.WatchOptions{
		Changes: changes,
		OnResult: func(r mptcp.Result, err error) {
			for _, w := range r.Warnings {
				log.Warn("MPTCP endpoints", "warning", w)
			}
			if err != nil {
				log.Warn("MPTCP endpoints not in step", "error", err)
				return
			}
			if r.Changed() {
				log.Info("MPTCP endpoints updated", "added", len(r.Added), "removed", len(r.Removed),
					"updated", len(r.Updated), "subflows_limit", r.Limits.Subflows)
			}
		},
	})
	if errors.Is(err, context.Canceled) || ctx.Err() != nil {
		return nil
	}
	return fmt.Errorf("agent: MPTCP endpoints: %w", err)
}
