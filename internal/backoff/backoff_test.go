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

package backoff

import (
	"context"
	"errors"
	"testing"
	"time"
)

func TestNextDoublesUpToMax(t *testing.T) {
	b := New(100*time.Millisecond, time.Second)
	want := []time.Duration{100, 200, 400, 800, 1000, 1000}
	for i, w := range want {
		if got := b.Next(); got != w*time.Millisecond {
			t.Fatalf("pause %d: %v, want %v", i, got, w*time.Millisecond)
		}
	}
	b.Reset()
	if got := b.Next(); got != 100*time.Millisecond {
		t.Errorf("after Reset: %v, want the first pause again", got)
	}
}

func TestMaxBelowFirst(t *testing.T) {
	b := New(time.Second, time.Millisecond)
	for range 3 {
		if got := b.Next(); got != time.Second {
			t.Fatalf("a cap below the first pause: %v, want 1s every time", got)
		}
	}
	var zero Backoff
	if got := zero.Next(); got != 0 {
		t.Errorf("the zero Backoff pauses %v", got)
	}
}

func TestWaitEndsWithTheContext(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	start := time.Now()
	if err := New(time.Hour, time.Hour).Wait(ctx); !errors.Is(err, context.Canceled) {
		t.Fatalf("Wait on an ended context: %v", err)
	}
	if time.Since(start) > 10*time.Second {
		t.Error("Wait on an ended context waited")
	}
	if err := Sleep(context.Background(), time.Millisecond); err != nil {
		t.Errorf("Sleep: %v", err)
	}
}
