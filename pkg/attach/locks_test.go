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
