package agent

import (
	"context"
	"fmt"

	"github.com/mpnbd/mpnbd/pkg/mptcp"
)

// runEndpoints keeps an MPTCP "signal" endpoint on every address of the
// configured storage NICs while the agent runs, so clients join a subflow
// to each. Only those endpoints are touched.
func (a *Agent) runEndpoints(ctx context.Context) error {
	// Port 0: the endpoints announce the port each connection uses, the
	// NBD server's, opened on each address before it is announced.
	d := mptcp.Desired{NICs: a.cfg.SignalNICs, Role: mptcp.RoleServer, StaleLossCount: a.cfg.StaleLossCount}
	if a.cfg.Listeners != nil {
		d.BeforeAdd = a.cfg.Listeners.Follow
	}
	var slow *mptcp.SlowPathPolicy
	if a.cfg.AutoBackup {
		slow = &mptcp.SlowPathPolicy{}
	}
	if err := mptcp.Keep(ctx, d, a.log, slow); err != nil {
		return fmt.Errorf("agent: %w", err)
	}
	return nil
}
