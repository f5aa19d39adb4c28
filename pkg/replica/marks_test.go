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

package replica

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"slices"
	"testing"
	"time"

	"github.com/mpnbd/mpnbd/pkg/nbd"
)

// ledgerReplica serves a replica of size bytes with a Ledger and returns
// a client of one connection to it, and the Ledger.
func ledgerReplica(t *testing.T, size int64) (*nbd.Client, *Ledger) {
	t.Helper()
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))
	l := NewLedger(size)
	srv := &nbd.Server{Logger: quiet}
	if err := srv.AddExport(&nbd.Export{Name: "r", Backend: nbd.NewMemBackend(size), Ledger: l}); err != nil {
		t.Fatal(err)
	}
	c1, c2 := net.Pipe()
	go srv.ServeConn(c2)
	t.Cleanup(func() {
		c1.Close()
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		srv.Shutdown(ctx)
	})
	info, err := nbd.NegotiateConn(context.Background(), c1, "r")
	if err != nil {
		t.Fatal(err)
	}
	return nbd.NewClient(info, []net.Conn{c1}, quiet), l
}

// waitUnsettled waits (bounded) until l's unsettled chunks are want.
func waitUnsettled(t *testing.T, l *Ledger, what string, want ...nbd.Range) {
	t.Helper()
	var got []nbd.Range
	var known bool
	for end := time.Now().Add(10 * time.Second); time.Now().Before(end); time.Sleep(10 * time.Millisecond) {
		if got, known = l.Unsettled(); known && slices.Equal(got, want) {
			return
		}
	}
	t.Fatalf("%s: the replica's ledger holds %v (known %v), want %v", what, got, known, want)
}

// TestMirrorSettleMarks: the primary's marks let a replica's ledger
// forget the forwards that settled, and keep one that has not (another
// replica holds it unanswered) until it settles: here, once that replica
// is recorded out.
func TestMirrorSettleMarks(t *testing.T) {
	arb := &fakeArbiter{epoch: 1}
	b, ledger := ledgerReplica(t, testSize)
	c := newMemPeer(testSize)
	m, err := New(Config{Local: nbd.NewMemBackend(testSize), Peers: map[string]Peer{"b": b, "c": c}, Epoch: 1, Arbiter: arb,
		Deadline: 3 * time.Second, MarkInterval: 20 * time.Millisecond, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Close() })
	for i := range 8 {
		if _, err := m.WriteAt(pattern(byte(i), 4096), int64(i)*Chunk); err != nil {
			t.Fatal(err)
		}
	}
	waitUnsettled(t, ledger, "every write settled")

	// c holds the next write unanswered: b has it, and keeps its chunk.
	c.hang = make(chan struct{})
	done := make(chan error, 1)
	go func() { _, err := m.WriteAt(pattern(9, 4096), 5*Chunk); done <- err }()
	time.Sleep(300 * time.Millisecond) // many marks
	if got, known := ledger.Unsettled(); !known || !slices.Equal(got, []nbd.Range{{Off: 5 * Chunk, Len: Chunk}}) {
		t.Fatalf("a write b has and c holds: the ledger holds %v (known %v), want chunk 5", got, known)
	}
	// Past the deadline c is dropped (recorded out): the write settles.
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the write never settled")
	}
	if d := arb.dropped(); !slices.Equal(d, []string{"c"}) {
		t.Fatalf("dropped %v, want c", d)
	}
	waitUnsettled(t, ledger, "the held write settled by c's drop")
	if s := fmt.Sprint(m.InSync()); s != "[b]" {
		t.Errorf("in sync: %s", s)
	}
}
