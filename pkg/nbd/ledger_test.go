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
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"
)

// recLedger records what its connections hear, as text.
type recLedger struct {
	mu     sync.Mutex
	events []string
	closed chan struct{}
}

func (l *recLedger) Open(ConnInfo) LedgerConn { return l }
func (l *recLedger) add(e string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.events = append(l.events, e)
}
func (l *recLedger) Changed(off, n uint64)  { l.add(fmt.Sprintf("changed %d+%d", off, n)) }
func (l *recLedger) Settled(mark, s uint64) { l.add(fmt.Sprintf("settled %d<%d", s, mark)) }
func (l *recLedger) Close()                 { l.add("close"); close(l.closed) }

// TestLedger: an export's ledger hears a connection's changes and settle
// marks in the order the client sent them, whatever order they run in,
// and the connection's end; reads and flushes are not changes. Without a
// ledger a settle mark is EINVAL; a mark that speaks for itself or a later
// one is refused by the client, and by the server when sent raw; a
// client of several connections cannot send marks.
func TestLedger(t *testing.T) {
	l := &recLedger{closed: make(chan struct{})}
	s := newTestServer(t, &Export{Name: "d", Backend: NewMemBackend(1 << 20), Ledger: l}, &Export{Name: "plain", Backend: NewMemBackend(1 << 20)})
	cl := dialPipe(t, s, "d", 1)
	steps := []func() error{
		func() error { _, err := cl.WriteAt(make([]byte, 4096), 0); return err },
		func() error { return cl.Settle(1, 0) },
		func() error { _, err := cl.ReadAt(make([]byte, 4096), 0); return err },
		func() error { return cl.Trim(8192, 4096) },
		func() error { return cl.WriteZeroes(16384, 8192, false) },
		cl.Flush,
		func() error { return cl.Settle(2, 1) },
	}
	for i, f := range steps {
		if err := f(); err != nil {
			t.Fatalf("step %d: %v", i, err)
		}
	}
	if err := cl.Settle(3, 3); err == nil {
		t.Error("a mark that speaks for itself was sent")
	}
	cl.Close()
	select {
	case <-l.closed:
	case <-time.After(5 * time.Second):
		t.Fatal("the ledger did not hear the connection's end")
	}
	want := []string{"changed 0+4096", "settled 0<1", "changed 8192+4096", "changed 16384+8192", "settled 1<2", "close"}
	l.mu.Lock()
	got := slices.Clone(l.events)
	l.mu.Unlock()
	if !slices.Equal(got, want) {
		t.Errorf("the ledger heard %q, want %q", got, want)
	}

	// A raw mark that speaks for a later one: EINVAL, the ledger not told.
	l2 := &recLedger{closed: make(chan struct{})}
	s2 := newTestServer(t, &Export{Name: "d", Backend: NewMemBackend(1 << 20), Ledger: l2})
	c := pipeConn(t, s2)
	if _, err := NegotiateConn(context.Background(), c, "d"); err != nil {
		t.Fatal(err)
	}
	sendReq(t, c, Request{Type: CmdSettle, Handle: 7, Offset: 2, Length: 5}, nil)
	if r := readRep(t, c); r.Handle != 7 || r.Errno != EINVAL {
		t.Errorf("a mark speaking for a later one: %+v, want EINVAL", r)
	}
	l2.mu.Lock()
	if len(l2.events) != 0 {
		t.Errorf("the ledger heard %q of a refused mark", l2.events)
	}
	l2.mu.Unlock()

	plain := dialPipe(t, s, "plain", 1)
	var ne *Error
	if err := plain.Settle(1, 0); !errors.As(err, &ne) || ne.Errno != EINVAL {
		t.Errorf("a mark on an export without a ledger: %v, want EINVAL", err)
	}
	if err := dialPipe(t, s, "plain", 2).Settle(1, 0); !errors.Is(err, errSettleMarks) {
		t.Errorf("a mark on a client of two connections: %v", err)
	}
}
