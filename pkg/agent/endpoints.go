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
		slow = &mptcp.SlowPathPolicy{OnEvent: a.cfg.OnPathEvent}
	}
	if err := mptcp.Keep(ctx, d, a.log, slow); err != nil {
		return fmt.Errorf("agent: %w", err)
	}
	return nil
}
