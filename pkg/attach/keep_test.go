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

package attach

import (
	"net"
	"testing"
	"time"
)

// TestKeeperHold: a connection short of its subflows is due for a new
// one only after it stayed short for the hold time; a connection with all
// of them resets the hold; a failed try doubles it up to the maximum.
func TestKeeperHold(t *testing.T) {
	cfg := KeepConfig{Want: 4, Hold: 10 * time.Second, MaxHold: 35 * time.Second}
	cfg.defaults()
	k := keeper{cfg: cfg, hold: cfg.Hold}
	a, b := &net.TCPConn{}, &net.TCPConn{}
	t0 := time.Now()
	for _, step := range []struct {
		c    net.Conn
		n    int
		at   time.Duration
		want bool
	}{
		{a, 3, 0, false},                // first seen short
		{a, 3, 9 * time.Second, false},  // within the hold
		{a, 3, 10 * time.Second, true},  // held long enough
		{b, 3, 11 * time.Second, false}, // another connection starts over
		{b, 4, 30 * time.Second, false}, // complete
		{b, 3, 31 * time.Second, false}, // short again: starts over
		{b, 3, 41 * time.Second, true},
	} {
		if got := k.due(step.c, step.n, t0.Add(step.at)); got != step.want {
			t.Fatalf("at %v with %d subflows: due %v, want %v", step.at, step.n, got, step.want)
		}
	}
	for _, want := range []time.Duration{20 * time.Second, 35 * time.Second, 35 * time.Second} {
		k.backoff()
		if k.hold != want {
			t.Fatalf("hold after a failed try %v, want %v", k.hold, want)
		}
	}
	k.due(b, 4, time.Now())
	if k.hold != cfg.Hold {
		t.Fatalf("hold after a complete connection %v, want %v", k.hold, cfg.Hold)
	}
}
