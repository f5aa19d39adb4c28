package mptcp

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
)

// Keep keeps the endpoints d describes in the calling thread's network
// namespace until ctx ends, following address changes, and logs what it
// does. It returns nil when ctx ends, or an error when the path manager
// or the address watch is unavailable.
func Keep(ctx context.Context, d Desired, log *slog.Logger) error {
	pm, err := DialPM()
	if err != nil {
		return fmt.Errorf("MPTCP path manager: %w", err)
	}
	defer pm.Close()
	addrs, err := DialAddrs()
	if err != nil {
		return fmt.Errorf("MPTCP endpoints: %w", err)
	}
	defer addrs.Close()
	changes, err := AddrChanges(ctx)
	if err != nil {
		// Periodic runs still catch address changes, only later.
		log.Warn("no address change notifications; endpoints follow changes at the next periodic run", "error", err)
		changes = nil
	}
	log = log.With("role", d.Role.String(), "nics", d.NICs)
	err = Watch(ctx, pm, addrs, d, WatchOptions{
		Changes: changes,
		OnResult: func(r Result, err error) {
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
	return fmt.Errorf("MPTCP endpoints: %w", err)
}
