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
	"context"
	"errors"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// writebackErrBackend reports a writeback error to one sync only, as
// Linux does for an open file: the sync after the failing one succeeds
// although the pages it could not write are gone.
type writebackErrBackend struct {
	Backend
	pending atomic.Bool // the next Sync fails
	syncs   atomic.Int64
}

var errWriteback = errors.New("writeback failed")

func (b *writebackErrBackend) Sync() error {
	b.syncs.Add(1)
	if b.pending.CompareAndSwap(true, false) {
		return errWriteback
	}
	return b.Backend.Sync()
}

// sessionClient negotiates a client on one TCP connection as generation
// gen of session id.
func sessionClient(t *testing.T, s *Server, id SessionID, gen uint64) (*Client, net.Conn) {
	t.Helper()
	c, info := sessionConn(t, s, id, gen)
	cl := NewClient(info, []net.Conn{c}, quietLogger())
	t.Cleanup(func() { cl.Close() })
	return cl, c
}

// waitConns waits until the export has n connections.
func waitConns(t *testing.T, e *Export, n int) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for e.ConnCount() != n {
		if time.Now().After(deadline) {
			t.Fatalf("export has %d connections, want %d", e.ConnCount(), n)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// TestSyncErrorSticksUntilFlushed: a sync that fails somewhere else than
// in a client's FLUSH (the end of another connection, Quiesce, another
// client's FLUSH) consumes the backend's error; every client connected
// then must still see its next FLUSH fail, once.
func TestSyncErrorSticksUntilFlushed(t *testing.T) {
	for _, tc := range []struct {
		name string
		fail func(t *testing.T, s *Server, e *Export)
	}{
		{"another connection ends", func(t *testing.T, s *Server, e *Export) {
			other := dialPipe(t, s, "d", 1)
			if _, err := other.WriteAt(make([]byte, 512), 4096); err != nil {
				t.Fatal(err)
			}
			waitConns(t, e, 2)
			other.Close()
			waitConns(t, e, 1)
		}},
		{"quiesce", func(t *testing.T, s *Server, e *Export) {
			if _, err := e.Quiesce(context.Background()); err == nil {
				t.Fatal("Quiesce hid the failed sync")
			}
		}},
		{"another client's flush", func(t *testing.T, s *Server, e *Export) {
			other := dialPipe(t, s, "d", 1)
			if err := other.Flush(); err == nil {
				t.Fatal("the flush whose sync failed succeeded")
			}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b := &writebackErrBackend{Backend: NewMemBackend(1 << 20)}
			e := &Export{Name: "d", Backend: b}
			s := newTestServer(t, e)
			cl := dialPipe(t, s, "d", 1)
			if _, err := cl.WriteAt(make([]byte, 512), 0); err != nil {
				t.Fatal(err)
			}
			b.pending.Store(true)
			tc.fail(t, s, e)
			if b.pending.Load() {
				t.Fatal("the failing sync did not run")
			}
			if err := cl.Flush(); err == nil {
				t.Fatal("FLUSH succeeded after a sync failed: acknowledged writes may be lost and the client was not told")
			}
			if err := cl.Flush(); err != nil {
				t.Fatalf("the failure was reported once; the next FLUSH: %v", err)
			}
		})
	}
}

// TestSyncErrorOwedToReconnectingSession: a session's connection ends and
// its final sync fails; another client is told first. The session's next
// connection must still be told.
func TestSyncErrorOwedToReconnectingSession(t *testing.T) {
	b := &writebackErrBackend{Backend: NewMemBackend(1 << 20)}
	e := &Export{Name: "d", Backend: b}
	s := newTestServer(t, e)
	id := NewSessionID()
	cl, _ := sessionClient(t, s, id, 1)
	if _, err := cl.WriteAt(make([]byte, 512), 0); err != nil {
		t.Fatal(err)
	}
	b.pending.Store(true)
	cl.Close()
	waitConns(t, e, 0)
	if b.pending.Load() {
		t.Fatal("the connection's end did not sync")
	}
	other := dialPipe(t, s, "d", 1)
	if err := other.Flush(); err == nil {
		t.Fatal("a connection opened after an unreported failure was not told")
	}
	again, _ := sessionClient(t, s, id, 2)
	if err := again.Flush(); err == nil {
		t.Fatal("the session's new connection was not told that its writes were lost")
	}
	if err := again.Flush(); err != nil {
		t.Fatalf("the failure was reported once; the next FLUSH: %v", err)
	}
	fresh := dialPipe(t, s, "d", 1)
	if err := fresh.Flush(); err != nil {
		t.Fatalf("a connection opened after the failure was reported: %v", err)
	}
}

// TestFUAWriteFailsWithSync: a FUA write whose sync fails fails, and does
// not count as reporting the failure: the next FLUSH fails too.
func TestFUAWriteFailsWithSync(t *testing.T) {
	b := &writebackErrBackend{Backend: NewMemBackend(1 << 20)}
	s := newTestServer(t, &Export{Name: "d", Backend: b})
	cl := dialPipe(t, s, "d", 1)
	b.pending.Store(true)
	if _, err := cl.WriteAtFlags(make([]byte, 512), 0, CmdFlagFUA); err == nil {
		t.Fatal("a FUA write whose sync failed succeeded")
	}
	if err := cl.Flush(); err == nil {
		t.Fatal("the FLUSH after a failed FUA write succeeded")
	}
	if _, err := cl.WriteAtFlags(make([]byte, 512), 0, CmdFlagFUA); err != nil {
		t.Fatalf("a FUA write after the failure was reported: %v", err)
	}
}

// TestSyncsCommitInGroups: concurrent FUA writes share syncs, and each
// waits for one that started after it arrived.
func TestSyncsCommitInGroups(t *testing.T) {
	gate := make(chan struct{})
	var entered atomic.Int64
	b := &blockingSync{Backend: NewMemBackend(1 << 20), gate: gate, entered: &entered}
	var es exportSyncs
	var wg sync.WaitGroup
	errs := make(chan error, 9)
	wg.Add(1)
	go func() { defer wg.Done(); errs <- es.sync(b) }()
	for entered.Load() != 1 {
		time.Sleep(time.Millisecond)
	}
	// Eight more arrive while the first sync runs: they need a sync that
	// starts after them, and share one.
	for i := 0; i < 8; i++ {
		wg.Add(1)
		go func() { defer wg.Done(); errs <- es.sync(b) }()
	}
	deadline := time.Now().Add(5 * time.Second)
	for {
		es.mu.Lock()
		waiting := es.waiting
		es.mu.Unlock()
		if waiting == 8 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d callers wait for the running sync, want 8", waiting)
		}
		time.Sleep(time.Millisecond)
	}
	close(gate)
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	// The eight needed a sync that started after they arrived, and one
	// served them all.
	if n := entered.Load(); n != 2 {
		t.Fatalf("%d syncs for 9 callers, 8 of which arrived during the first: want 2", n)
	}
}

type blockingSync struct {
	Backend
	gate    chan struct{}
	entered *atomic.Int64
}

func (b *blockingSync) Sync() error {
	b.entered.Add(1)
	<-b.gate
	return nil
}
