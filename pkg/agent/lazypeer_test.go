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
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/mpnbd/mpnbd/pkg/nbd"
)

// TestLazyPeer: a forward's connection is dialled on the first call and
// only once; a dial that failed fails every later call without dialling
// again (the Mirror drops the replica; its rebuild dials anew); Close
// ends a dial under way, and the calls waiting on it fail.
func TestLazyPeer(t *testing.T) {
	var dials atomic.Int64
	failing := errors.New("replica unreachable")
	p := &lazyPeer{ctx: context.Background(), cancel: func() {}, dial: func(context.Context) (*nbd.Client, error) {
		dials.Add(1)
		return nil, failing
	}}
	if _, err := p.WriteAt(make([]byte, 512), 0); !errors.Is(err, failing) {
		t.Fatalf("the first write: %v", err)
	}
	if err := p.Flush(); !errors.Is(err, failing) || dials.Load() != 1 {
		t.Fatalf("a FLUSH after the failed dial: %v, %d dials", err, dials.Load())
	}

	ctx, cancel := context.WithCancel(context.Background())
	hanging := &lazyPeer{ctx: ctx, cancel: cancel, dial: func(ctx context.Context) (*nbd.Client, error) {
		<-ctx.Done()
		return nil, ctx.Err()
	}}
	done := make(chan error, 2)
	go func() { done <- hanging.Trim(0, 512) }()
	go func() { done <- hanging.WriteZeroes(0, 512, false) }()
	time.Sleep(50 * time.Millisecond)
	if err := hanging.Close(); err != nil {
		t.Fatal(err)
	}
	for range 2 {
		select {
		case err := <-done:
			if err == nil {
				t.Error("a call waiting on a dial that Close ended succeeded")
			}
		case <-time.After(10 * time.Second):
			t.Fatal("Close did not end the dial under way")
		}
	}
	if _, err := hanging.WriteAt(make([]byte, 512), 0); !errors.Is(err, nbd.ErrClosed) {
		t.Errorf("a write after Close: %v, want ErrClosed", err)
	}
}
