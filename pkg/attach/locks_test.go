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
	"sync"
	"testing"
	"time"
)

func TestVolumeLocks(t *testing.T) {
	var ls VolumeLocks
	unlockA := ls.Lock("a")
	// Another volume is not held up.
	done := make(chan struct{})
	go func() { ls.Lock("b")(); close(done) }()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("volume b waited for volume a's lock")
	}
	// The same volume is.
	var mu sync.Mutex
	order := []string{}
	got := make(chan struct{})
	go func() {
		unlock := ls.Lock("a")
		mu.Lock()
		order = append(order, "second")
		mu.Unlock()
		unlock()
		close(got)
	}()
	time.Sleep(50 * time.Millisecond)
	mu.Lock()
	order = append(order, "first")
	mu.Unlock()
	unlockA()
	<-got
	if order[0] != "first" || order[1] != "second" {
		t.Fatalf("order %v: the second holder of a did not wait", order)
	}
	ls.mu.Lock()
	left := len(ls.m)
	ls.mu.Unlock()
	if left != 0 {
		t.Fatalf("%d locks kept after every holder let go", left)
	}
}
