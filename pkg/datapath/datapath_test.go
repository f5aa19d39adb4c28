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

package datapath

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/netip"
	"path/filepath"
	"reflect"
	"sync"
	"testing"
	"time"

	"github.com/mpnbd/mpnbd/pkg/attach"
)

// fakeService records calls and answers from its fields.
type fakeService struct {
	mu       sync.Mutex
	attached map[string]attach.Transport
	block    chan struct{} // Attach waits on it when set
	cancels  int
	resize   error // what Resize fails with; nil: ErrTooSmall
}

func (f *fakeService) Attach(ctx context.Context, tr attach.Transport, t attach.Target, o attach.Options) (*attach.Attachment, error) {
	if f.block != nil {
		select {
		case <-f.block:
		case <-ctx.Done():
			f.mu.Lock()
			f.cancels++
			f.mu.Unlock()
			return nil, ctx.Err()
		}
	}
	if t.VolumeID == "bad" {
		return nil, fmt.Errorf("%w: transport %q", attach.ErrInvalid, tr)
	}
	f.mu.Lock()
	f.attached[t.VolumeID] = tr
	f.mu.Unlock()
	return &attach.Attachment{VolumeID: t.VolumeID, Transport: tr, Device: "/dev/ublkb3", Size: o.BlockSize << 20, MPTCP: true,
		Choice: &attach.Choice{Requested: attach.Auto, Skipped: []attach.Fallback{{VolumeID: t.VolumeID, From: attach.Kernel, To: tr, Reason: "EINVAL"}}, Missing: []attach.Transport{attach.Relay}}}, nil
}

func (f *fakeService) Detach(ctx context.Context, id string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	delete(f.attached, id)
	return nil
}

// testPaths are the bytes per path the fake service reports.
var testPaths = []attach.PathStats{
	{Connection: 0, Local: netip.MustParseAddrPort("10.77.1.1:40000"), Remote: netip.MustParseAddrPort("10.77.1.2:10809"), SentBytes: 1 << 40, ReceivedBytes: 7},
	{Connection: 0, Local: netip.MustParseAddrPort("[fd00::1]:40001"), Remote: netip.MustParseAddrPort("[fd00::2]:10900")},
}

func (f *fakeService) Health(id string) (attach.Transport, attach.Health, error) {
	f.mu.Lock()
	tr, ok := f.attached[id]
	f.mu.Unlock()
	if !ok {
		return "", attach.Health{}, fmt.Errorf("%w: %s", attach.ErrNotAttached, id)
	}
	return tr, attach.Health{Connected: true, Subflows: []int{4}, Paths: testPaths, Outage: 1500 * time.Millisecond, Failing: true, Message: "m"}, nil
}

func (f *fakeService) Resize(ctx context.Context, id string, n uint64) (uint64, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.resize != nil {
		return 0, f.resize
	}
	return 0, fmt.Errorf("%w: export has less", attach.ErrTooSmall)
}

func (f *fakeService) Volumes() map[string]attach.Transport {
	f.mu.Lock()
	defer f.mu.Unlock()
	out := map[string]attach.Transport{}
	for k, v := range f.attached {
		out[k] = v
	}
	return out
}

func (f *fakeService) Adopt(ctx context.Context) ([]*attach.Attachment, error) {
	return []*attach.Attachment{{VolumeID: "old", Transport: attach.Relay}}, errors.New("one volume could not be taken over")
}

func (f *fakeService) Available() []attach.Transport {
	return []attach.Transport{attach.Ublk, attach.FUSE}
}

func quiet() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

func serve(t *testing.T, path string, svc Service) (stop func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- Serve(ctx, path, svc, quiet()) }()
	c := &Client{Path: path}
	deadline := time.Now().Add(5 * time.Second)
	for c.Available() == nil {
		if time.Now().After(deadline) {
			t.Fatal("the datapath server did not come up")
		}
		time.Sleep(10 * time.Millisecond)
	}
	stopped := false
	stop = func() {
		if stopped {
			return
		}
		stopped = true
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("Serve: %v", err)
			}
		case <-time.After(10 * time.Second):
			t.Error("Serve did not return")
		}
	}
	t.Cleanup(stop)
	return stop
}

// TestRoundTrip: every method crosses the socket with its values, and the
// sentinel errors stay errors.Is-matchable on the client side.
func TestRoundTrip(t *testing.T) {
	path := filepath.Join(t.TempDir(), "dp.sock")
	svc := &fakeService{attached: map[string]attach.Transport{}}
	serve(t, path, svc)
	c := &Client{Path: path}
	ctx := context.Background()
	att, err := c.Attach(ctx, attach.Ublk, attach.Target{VolumeID: "v1", Addrs: []string{"a:1", "b:2"}}, attach.Options{BlockSize: 4096, DeadConnTimeout: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	want := attach.Attachment{VolumeID: "v1", Transport: attach.Ublk, Device: "/dev/ublkb3", Size: 4096 << 20, MPTCP: true,
		Choice: &attach.Choice{Requested: attach.Auto, Skipped: []attach.Fallback{{VolumeID: "v1", From: attach.Kernel, To: attach.Ublk, Reason: "EINVAL"}}, Missing: []attach.Transport{attach.Relay}}}
	// The node plugin tells the user how the transport was chosen.
	if !reflect.DeepEqual(*att, want) {
		t.Fatalf("attachment %+v (choice %+v), want %+v", *att, att.Choice, want)
	}
	if _, err := c.Attach(ctx, attach.Relay, attach.Target{VolumeID: "bad"}, attach.Options{}); !errors.Is(err, attach.ErrInvalid) {
		t.Fatalf("attach error %v, want ErrInvalid", err)
	}
	tr, h, err := c.Health("v1")
	if err != nil || tr != attach.Ublk || !h.Connected || h.Outage != 1500*time.Millisecond || !h.Failing || len(h.Subflows) != 1 || h.Subflows[0] != 4 {
		t.Fatalf("health %s %+v %v", tr, h, err)
	}
	if !reflect.DeepEqual(h.Paths, testPaths) {
		t.Fatalf("health paths %+v, want %+v", h.Paths, testPaths)
	}
	if _, _, err := c.Health("nope"); !errors.Is(err, attach.ErrNotAttached) {
		t.Fatalf("health of an unknown volume: %v, want ErrNotAttached", err)
	}
	if _, err := c.Resize(ctx, "v1", 1); !errors.Is(err, attach.ErrTooSmall) {
		t.Fatalf("resize: %v, want ErrTooSmall", err)
	}
	if v := c.Volumes(); len(v) != 1 || v["v1"] != attach.Ublk {
		t.Fatalf("volumes %v", v)
	}
	atts, err := c.Adopt(ctx)
	if err == nil || len(atts) != 1 || atts[0].VolumeID != "old" {
		t.Fatalf("adopt: %+v, %v (want one attachment and the error)", atts, err)
	}
	if a := c.Available(); len(a) != 2 || a[0] != attach.Ublk {
		t.Fatalf("available %v", a)
	}
	if err := c.Detach(ctx, "v1"); err != nil || len(c.Volumes()) != 0 {
		t.Fatalf("detach: %v, volumes %v", err, c.Volumes())
	}
}

// TestErrorWrappingSeveralSentinels: an error of the component that wraps
// two sentinels reaches the node plugin wrapping the same two, whichever
// they are, so the one mapping to gRPC codes (pkg/driver toStatus) gives
// the code it gives in process; the Kind an older peer reads is the first
// in that mapping's order, the same on every call.
func TestErrorWrappingSeveralSentinels(t *testing.T) {
	path := filepath.Join(t.TempDir(), "dp.sock")
	svc := &fakeService{attached: map[string]attach.Transport{}}
	serve(t, path, svc)
	c := &Client{Path: path}
	for i, a := range sentinels {
		for _, b := range sentinels[i+1:] {
			// ErrUnavailable is the client's own when the component is
			// gone: the component never sends it, but it crosses fine.
			orig := fmt.Errorf("resize: %w, then %w", b.err, a.err)
			svc.mu.Lock()
			svc.resize = orig
			svc.mu.Unlock()
			_, got := c.Resize(context.Background(), "v", 1)
			if got == nil || got.Error() != orig.Error() {
				t.Fatalf("%s+%s: the client got %v, want %q", a.kind, b.kind, got, orig)
			}
			for _, s := range sentinels {
				if errors.Is(got, s.err) != errors.Is(orig, s.err) {
					t.Errorf("%s+%s: errors.Is(%s) is %v across the socket, %v in the component",
						a.kind, b.kind, s.kind, errors.Is(got, s.err), errors.Is(orig, s.err))
				}
			}
			for range 20 {
				if w := toWire(orig); w.Kind != a.kind || len(w.Kinds) != 2 || w.Kinds[0] != a.kind || w.Kinds[1] != b.kind {
					t.Fatalf("%s+%s: wire %+v, want kind %s and kinds [%s %s]", a.kind, b.kind, w, a.kind, a.kind, b.kind)
				}
			}
		}
	}
	// An older component names one kind only.
	old := (&WireError{Kind: "not_attached", Message: "m"}).err()
	if !errors.Is(old, attach.ErrNotAttached) || errors.Is(old, attach.ErrInvalid) || old.Error() != "m" {
		t.Errorf("an error of an older component: %v", old)
	}
	if e := (&WireError{Kind: "from-the-future", Message: "m"}).err(); e == nil || e.Error() != "m" {
		t.Errorf("an unknown kind: %v", e)
	}
}

// TestComponentRestart: while the component is down calls fail with
// ErrUnavailable (not hang); once it is back on the same socket they work.
func TestComponentRestart(t *testing.T) {
	path := filepath.Join(t.TempDir(), "dp.sock")
	svc := &fakeService{attached: map[string]attach.Transport{}}
	stop := serve(t, path, svc)
	c := &Client{Path: path, DialTimeout: time.Second}
	if _, err := c.Attach(context.Background(), attach.FUSE, attach.Target{VolumeID: "v"}, attach.Options{}); err != nil {
		t.Fatal(err)
	}
	stop()
	start := time.Now()
	if _, _, err := c.Health("v"); !errors.Is(err, ErrUnavailable) {
		t.Fatalf("health with the component down: %v, want ErrUnavailable", err)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Fatalf("a call to a stopped component took %v", d)
	}
	serve(t, path, svc)
	if tr, _, err := c.Health("v"); err != nil || tr != attach.FUSE {
		t.Fatalf("health after the restart: %s, %v", tr, err)
	}
}

// TestCallCancelled: a caller's context ends its call at once; the work
// goes on in the component (a retried attach then finds it done) until
// the component's own lifetime ends it.
func TestCallCancelled(t *testing.T) {
	path := filepath.Join(t.TempDir(), "dp.sock")
	svc := &fakeService{attached: map[string]attach.Transport{}, block: make(chan struct{})}
	stop := serve(t, path, svc)
	c := &Client{Path: path}
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	if _, err := c.Attach(ctx, attach.Relay, attach.Target{VolumeID: "slow"}, attach.Options{}); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("attach past the caller's deadline: %v", err)
	}
	stop()
	svc.mu.Lock()
	n := svc.cancels
	svc.mu.Unlock()
	if n != 1 {
		t.Fatalf("%d attaches cancelled by the component's end, want 1", n)
	}
}

// TestServeReadyOnlyOnceListening: the ready callback runs when the
// socket accepts calls (the datapath's ready file is written there: a
// node plugin that trusts it must not meet a socket that refuses), and
// its error stops serving.
func TestServeReadyOnlyOnceListening(t *testing.T) {
	path := filepath.Join(t.TempDir(), "datapath.sock")
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	svc := &fakeService{}
	called := make(chan error, 1)
	done := make(chan error, 1)
	go func() {
		done <- ServeGeneration(ctx, path, svc, quiet(), 0, func() error {
			// Called from the serving goroutine before its accept loop:
			// the backlog takes the connection, the call waits for it.
			called <- nil
			return nil
		})
	}()
	select {
	case <-called:
	case err := <-done:
		t.Fatalf("ServeGeneration returned before it was ready: %v", err)
	case <-time.After(5 * time.Second):
		t.Fatal("ready not called in 5 s")
	}
	// No retry: the first call after ready must be answered.
	c := &Client{Path: path}
	if tr := c.Available(); tr == nil {
		t.Fatal("the datapath did not answer right after it said ready")
	}
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("ServeGeneration: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("ServeGeneration did not return")
	}

	failing := errors.New("no ready file")
	err := ServeGeneration(context.Background(), filepath.Join(t.TempDir(), "d.sock"), svc, quiet(), 0, func() error { return failing })
	if !errors.Is(err, failing) {
		t.Fatalf("ServeGeneration with a failing ready: %v, want %v", err, failing)
	}
}
