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
	"errors"
	"sync/atomic"
	"testing"
)

// withholdingBackend withholds its answers once told to: its writes, its
// syncs, or its reads.
type withholdingBackend struct {
	Backend
	writes, syncs, reads atomic.Bool
	syncCalls            atomic.Int64
}

func (b *withholdingBackend) WriteAt(p []byte, off int64) (int, error) {
	if b.writes.Load() {
		return 0, ErrWithheld
	}
	return b.Backend.WriteAt(p, off)
}

func (b *withholdingBackend) ReadAt(p []byte, off int64) (int, error) {
	if b.reads.Load() {
		return 0, ErrWithheld
	}
	return b.Backend.ReadAt(p, off)
}

func (b *withholdingBackend) Sync() error {
	b.syncCalls.Add(1)
	if b.syncs.Load() {
		return ErrWithheld
	}
	return b.Backend.Sync()
}

// TestWithheldReplyClosesTheConnection: a request whose backend withholds
// the answer gets no reply at all, neither success nor an error: the
// connection closes under it (ErrClosed at the client, whose session
// would replay it). A withheld sync is no failed sync: it does not fail
// the FLUSH of another client, and every later sync is withheld without
// reaching the backend.
func TestWithheldReplyClosesTheConnection(t *testing.T) {
	for _, tc := range []struct {
		name string
		arm  func(b *withholdingBackend)
		do   func(cl *Client) error
	}{
		{"write", func(b *withholdingBackend) { b.writes.Store(true) }, func(cl *Client) error {
			_, err := cl.WriteAt(make([]byte, 4096), 0)
			return err
		}},
		{"read", func(b *withholdingBackend) { b.reads.Store(true) }, func(cl *Client) error {
			_, err := cl.ReadAt(make([]byte, 4096), 0)
			return err
		}},
		{"flush", func(b *withholdingBackend) { b.syncs.Store(true) }, func(cl *Client) error { return cl.Flush() }},
		{"FUA write", func(b *withholdingBackend) { b.syncs.Store(true) }, func(cl *Client) error {
			_, err := cl.WriteAtFlags(make([]byte, 4096), 0, CmdFlagFUA)
			return err
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b := &withholdingBackend{Backend: NewMemBackend(1 << 20)}
			s := newTestServer(t, &Export{Name: "d", Backend: b})
			cl := dialPipe(t, s, "d", 1)
			if _, err := cl.WriteAt(make([]byte, 4096), 0); err != nil {
				t.Fatal(err)
			}
			tc.arm(b)
			err := tc.do(cl)
			var nerr *Error
			switch {
			case err == nil:
				t.Fatal("a request whose answer the backend withheld succeeded")
			case errors.As(err, &nerr):
				t.Fatalf("a request whose answer the backend withheld got an error reply (%v): the client would fail the application's I/O instead of replaying it", err)
			case !errors.Is(err, ErrClosed):
				t.Fatalf("want the connection closed, got %v", err)
			}
		})
	}

	t.Run("a withheld sync fails no flush and stays withheld", func(t *testing.T) {
		b := &withholdingBackend{Backend: NewMemBackend(1 << 20)}
		e := &Export{Name: "d", Backend: b}
		s := newTestServer(t, e)
		cl := dialPipe(t, s, "d", 1)
		b.syncs.Store(true)
		if err := e.Sync(); !errors.Is(err, ErrWithheld) {
			t.Fatalf("Sync: %v, want ErrWithheld", err)
		}
		calls := b.syncCalls.Load()
		if err := cl.Flush(); err == nil || !errors.Is(err, ErrClosed) {
			t.Fatalf("FLUSH after a withheld sync: %v, want the connection closed", err)
		}
		if err := e.Sync(); !errors.Is(err, ErrWithheld) {
			t.Fatalf("the sync after a withheld one: %v, want ErrWithheld", err)
		}
		if n := b.syncCalls.Load(); n != calls {
			t.Fatalf("the backend was synced %d more times after it withheld a sync", n-calls)
		}
	})
}
