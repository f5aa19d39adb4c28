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

package replenv

import (
	"fmt"
	"sync"
	"syscall"
	"testing"
	"time"
	"unsafe"
)

// PauseProbe writes one block at off of a device every 100ms, each write
// O_DIRECT and O_DSYNC, and keeps the longest time between two completed
// writes, and every error.
type PauseProbe struct {
	mu      sync.Mutex
	last    time.Time
	longest time.Duration
	errs    []error
	stop    chan struct{}
	done    chan struct{}
}

// StartPauseProbe starts a probe of dev at off; t's cleanup ends it.
func StartPauseProbe(t testing.TB, dev string, off int64) *PauseProbe {
	t.Helper()
	// Close-on-exec: an agent started while the probe runs must not
	// inherit the device (it would keep the client from detaching).
	fd, err := syscall.Open(dev, syscall.O_WRONLY|syscall.O_DIRECT|syscall.O_DSYNC|syscall.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	buf := aligned(4096)
	p := &PauseProbe{last: time.Now(), stop: make(chan struct{}), done: make(chan struct{})}
	go func() {
		defer close(p.done)
		defer syscall.Close(fd)
		for i := 0; ; i++ {
			select {
			case <-p.stop:
				return
			case <-time.After(100 * time.Millisecond):
			}
			copy(buf, fmt.Sprintf("probe %d", i))
			_, err := syscall.Pwrite(fd, buf, off)
			p.mu.Lock()
			if err != nil {
				p.errs = append(p.errs, err)
			}
			now := time.Now()
			p.longest = max(p.longest, now.Sub(p.last))
			p.last = now
			p.mu.Unlock()
		}
	}()
	t.Cleanup(p.End)
	return p
}

// Resumed waits, up to timeout, for a write completed after the call:
// the pause under way, if any, is then whole in the next Take.
func (p *PauseProbe) Resumed(timeout time.Duration) error {
	since := time.Now()
	end := since.Add(timeout)
	for {
		p.mu.Lock()
		last := p.last
		p.mu.Unlock()
		if last.After(since) {
			return nil
		}
		if time.Now().After(end) {
			return fmt.Errorf("no write completed for %v", time.Since(last).Round(time.Millisecond))
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// Take returns the longest pause since the last Take (including the one
// under way) and starts afresh; and the errors.
func (p *PauseProbe) Take() (time.Duration, []error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	l := max(p.longest, time.Since(p.last))
	p.longest = 0
	errs := p.errs
	p.errs = nil
	return l, errs
}

// Pause waits, up to timeout, for the probe's writes to go on (Resumed)
// and returns the longest pause since the last Take; an error if they do
// not resume or any failed.
func (p *PauseProbe) Pause(timeout time.Duration) (time.Duration, error) {
	if err := p.Resumed(timeout); err != nil {
		return 0, fmt.Errorf("the probe's writes did not resume: %w", err)
	}
	pause, errs := p.Take()
	if len(errs) > 0 {
		return pause, fmt.Errorf("the probe's writes failed: %v", errs)
	}
	return pause, nil
}

// End stops the probe; a write that hangs (the test failed with the
// volume unreachable) is left behind after 10s.
func (p *PauseProbe) End() {
	select {
	case <-p.stop:
	default:
		close(p.stop)
	}
	select {
	case <-p.done:
	case <-time.After(10 * time.Second):
	}
}

// aligned is a buffer of n bytes aligned for O_DIRECT.
func aligned(n int) []byte {
	raw := make([]byte, n+4096)
	shift := (4096 - int(uintptr(unsafe.Pointer(&raw[0]))&4095)) & 4095
	return raw[shift : shift+n]
}

// DirectIO writes buf to dev at off (reads when !write), O_DIRECT and,
// for a write, O_DSYNC.
func DirectIO(dev string, buf []byte, off int64, write bool) error {
	flags := syscall.O_RDONLY | syscall.O_DIRECT
	if write {
		flags = syscall.O_WRONLY | syscall.O_DIRECT | syscall.O_DSYNC
	}
	fd, err := syscall.Open(dev, flags, 0)
	if err != nil {
		return err
	}
	defer syscall.Close(fd)
	a := aligned(len(buf))
	var n int
	if write {
		copy(a, buf)
		n, err = syscall.Pwrite(fd, a, off)
	} else {
		n, err = syscall.Pread(fd, a, off)
		copy(buf, a)
	}
	if err == nil && n != len(buf) {
		err = fmt.Errorf("%d of %d bytes", n, len(buf))
	}
	return err
}
