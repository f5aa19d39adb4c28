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

package topo

import (
	"fmt"
	"sync"
	"time"

	"github.com/mpnbd/mpnbd/pkg/mptcp"
)

// callerEndpoints is how many MPTCP endpoints the kernel keeps per
// network namespace (MPTCP_PM_ADDR_MAX): every local address a subflow
// leaves from takes one, an implicit endpoint if it has none. Topologies
// whose client is the caller's namespace share that namespace's, so they
// take turns: each holds one per path but the first while it exists.
const callerEndpoints = 8

// callerWait bounds how long Up waits for other such topologies to go.
const callerWait = 10 * time.Minute

var callerBudget struct {
	mu   sync.Mutex
	used int
}

// takeCallerEndpoints reserves n of the caller namespace's endpoints,
// waiting (bounded) for other topologies to release theirs.
func takeCallerEndpoints(n int) error {
	if n > callerEndpoints {
		return fmt.Errorf("topo: a client in the caller's namespace has room for %d paths, not %d", callerEndpoints+1, n+1)
	}
	deadline := time.Now().Add(callerWait)
	for {
		callerBudget.mu.Lock()
		if callerBudget.used+n <= callerEndpoints {
			callerBudget.used += n
			callerBudget.mu.Unlock()
			return nil
		}
		callerBudget.mu.Unlock()
		if time.Now().After(deadline) {
			return fmt.Errorf("topo: other topologies held the caller namespace's MPTCP endpoints for %v (at most %d paths but the first at once: does one test hold too many?)", callerWait, callerEndpoints)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func releaseCallerEndpoints(n int) {
	callerBudget.mu.Lock()
	callerBudget.used -= n
	callerBudget.mu.Unlock()
}

// dropCallerEndpoints deletes the endpoints the kernel made in the
// caller's namespace for the topology's client addresses: they outlive
// the addresses and would keep counting against callerEndpoints.
func (t *Topology) dropCallerEndpoints() error {
	return InNetns(t.ClientNS, func() error {
		pm, err := mptcp.DialPM()
		if err != nil {
			return err
		}
		defer pm.Close()
		eps, err := pm.Endpoints()
		if err != nil {
			return err
		}
		for _, e := range eps {
			if t.PathOf(e.Addr) > 0 {
				if err := pm.DeleteEndpoint(e.ID); err != nil {
					return fmt.Errorf("topo: delete endpoint %d (%v): %w", e.ID, e.Addr, err)
				}
			}
		}
		return nil
	})
}
