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

package nbd

import (
	"net"
	"net/netip"
	"testing"
)

// flood opens n connections from src that never send anything and waits,
// for each, until the server counted it in or refused it. It returns the
// connections; the refused ones are closed by the server.
func (e *limitEnv) flood(src string, n int) []net.Conn {
	e.t.Helper()
	// The observer's lock is not held while the server's is taken: the
	// server reports its counts to the observer under its own.
	settled := func() int {
		e.obs.mu.Lock()
		r := 0
		for _, v := range e.obs.refused {
			r += v
		}
		e.obs.mu.Unlock()
		return e.srv.ConnStats().Handshakes + r
	}
	var cs []net.Conn
	for range n {
		before := settled()
		cs = append(cs, e.dial(src))
		e.waitFor("a flood connection from "+src+" to be counted or refused", func() bool { return settled() == before+1 })
	}
	return cs
}

// Many connections from a few unknown addresses stalled in the handshake
// cannot keep the nodes the server knows out: they fill only the slots
// not reserved, while the published nodes' connections still get
// through, and one known address cannot take the reserve alone.
func TestLimitReservedHandshakes(t *testing.T) {
	forTransports(t, func(t *testing.T, useMPTCP bool) {
		e := newLimitEnv(t, Limits{MaxHandshakes: 10, MaxHandshakesPerSource: 4, ReservedHandshakes: 6, HandshakeTimeout: -1}, useMPTCP)
		e.srv.SetKnownSources([]netip.Addr{netip.MustParseAddr("127.0.0.9"), netip.MustParseAddr("::ffff:127.0.0.10")})

		var stalled []net.Conn
		for _, src := range []string{"127.0.0.1", "127.0.0.2", "127.0.0.3"} {
			stalled = append(stalled, e.flood(src, 4)...)
		}
		if st := e.srv.ConnStats(); st.Handshakes != 4 || st.UnknownHandshakes != 4 {
			t.Errorf("unknown sources hold %+v, want the 4 shared handshake slots", st)
		}
		if n := e.obs.refusals(RefusedHandshakesUnknown); n != 8 {
			t.Errorf("%d connections refused for the unknown sources' share, want 8", n)
		}
		e.serves("127.0.0.9", "d", "published node during the flood")

		// A known address holds its per-source share, no more: the other
		// known address still gets in.
		stalled = append(stalled, e.flood("127.0.0.9", 5)...)
		if n := e.obs.refusals(RefusedHandshakesPerSource); n != 1 {
			t.Errorf("%d connections from 127.0.0.9 refused by the per-source limit, want 1", n)
		}
		e.serves("127.0.0.10", "d", "second published node while the first holds its share")
		e.closeAll(stalled)
	})
}

// Without SetKnownSources every handshake slot is shared, as before.
func TestLimitReserveNeedsKnownSources(t *testing.T) {
	e := newLimitEnv(t, Limits{MaxHandshakes: 4, HandshakeTimeout: -1}, false)
	flood := e.idle("127.0.0.1", 2, 2)
	flood = append(flood, e.idle("127.0.0.2", 2, 4)...)
	if st := e.srv.ConnStats(); st.UnknownHandshakes != 0 {
		t.Errorf("stats %+v: unknown handshakes counted without known sources", st)
	}
	e.closeAll(flood)
}
