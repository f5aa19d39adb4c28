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

package relay

import (
	"context"
	"errors"
	"io"
	"net"
	"testing"
	"time"
)

// TestDeadPeerBlackHoleReplaced: a remote that takes requests and never
// answers, with no kernel to ask about its peer (a pipe), is judged by
// progress alone: after DeadPeerTimeout the relay closes it, redials and
// the request completes on the new connection.
func TestDeadPeerBlackHoleReplaced(t *testing.T) {
	checkGoroutines(t)
	ts := newTestServer(t, 1<<20, false)
	probe, info, err := dialNegotiated(context.Background(), ts.addr, false)
	if err != nil {
		t.Fatal(err)
	}
	probe.Close()
	hole, holeEnd := net.Pipe()
	go func() { _, _ = io.Copy(io.Discard, holeEnd) }()
	t.Cleanup(func() { holeEnd.Close() })
	rg := newRig(t, hole, negotiatingDialer(ts.addr, false), &info, Options{DeadPeerTimeout: MinDeadPeerTimeout})
	done := make(chan error, 1)
	go func() {
		_, err := rg.client.WriteAt(make([]byte, 4096), 0)
		done <- err
	}()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(10 * MinDeadPeerTimeout):
		t.Fatalf("the write did not complete: the silent remote was not replaced (stats %+v)", rg.relay.Stats())
	}
	st := rg.relay.Stats()
	if st.DeadPeers != 1 || st.Reconnects != 1 {
		t.Fatalf("stats %+v: want one connection declared dead and one reconnect", st)
	}
	ev := rg.eventsOf(EventDisconnected)
	if len(ev) != 1 || !errors.Is(ev[0].Err, ErrDeadPeer) {
		t.Fatalf("disconnect events %+v: want one for ErrDeadPeer", ev)
	}
}
