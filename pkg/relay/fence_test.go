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

package relay

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sync/atomic"
	"testing"
	"time"

	"github.com/mpnbd/mpnbd/pkg/nbd"
)

// refusingServer serves exportName, or refuses it as its mode says.
type refusingServer struct {
	srv  *nbd.Server
	addr string
	mode atomic.Value // "", "unknown", "denied" or "superseded"
}

func newRefusingServer(t *testing.T) *refusingServer {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	rs := &refusingServer{addr: ln.Addr().String()}
	rs.mode.Store("")
	rs.srv = &nbd.Server{Logger: quietLogger()}
	rs.srv.Resolve = func(_ nbd.ConnInfo, name string) (nbd.Grant, error) {
		switch rs.mode.Load().(string) {
		case "unknown":
			return nbd.Grant{}, fmt.Errorf("not open yet: %w", nbd.ErrUnknownExport)
		case "denied":
			return nbd.Grant{}, errors.New("not published")
		case "superseded":
			return nbd.Grant{}, fmt.Errorf("epoch 3, now 5: %w", nbd.ErrSuperseded)
		}
		return nbd.Grant{Export: name}, nil
	}
	if err := rs.srv.AddExport(&nbd.Export{Name: exportName, Backend: nbd.NewMemBackend(1 << 20)}); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		rs.srv.Serve(ln)
	}()
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		rs.srv.Shutdown(ctx)
		<-done
	})
	return rs
}

// drop closes the server's connections, as a storage agent does when it
// revokes a grant.
func (rs *refusingServer) drop(t *testing.T) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if _, err := rs.srv.CloseConns(ctx, exportName, func(nbd.ConnInfo) bool { return true }); err != nil {
		t.Fatal(err)
	}
}

// TestFencedEndsTheRelay: a server that refuses the export as superseded
// (the grant was replaced: the volume was published to the node again)
// ends the relay: the request waiting is answered with EIO and Run
// returns ErrFenced, with no FailAfter set (a hard mount). Every other
// refusal (an unknown export, as from a storage agent restarting; access
// denied) only makes it dial again, and it carries on once served.
func TestFencedEndsTheRelay(t *testing.T) {
	checkGoroutines(t)
	rs := newRefusingServer(t)
	remote, info, err := dialNegotiated(context.Background(), rs.addr, false)
	if err != nil {
		t.Fatal(err)
	}
	rg := newRig(t, remote, negotiatingDialer(rs.addr, false), &info, Options{ReconnectBackoff: 10 * time.Millisecond, MaxBackoff: 50 * time.Millisecond})
	data := randomData(4096, 5)
	if _, err := rg.client.WriteAt(data, 0); err != nil {
		t.Fatal(err)
	}

	// Passing refusals: the write waits, and lands once served.
	for _, mode := range []string{"unknown", "denied"} {
		rs.mode.Store(mode)
		rs.drop(t)
		written := make(chan error, 1)
		go func() {
			_, err := rg.client.WriteAt(data, 8192)
			written <- err
		}()
		waitFor(t, 10*time.Second, "redials refused ("+mode+")", func() bool {
			return rg.relay.Stats().InFlight == 1 && !rg.relay.Stats().Connected
		})
		select {
		case err := <-rg.done:
			t.Fatalf("a refusal (%s) ended the relay: %v", mode, err)
		case <-time.After(200 * time.Millisecond):
		}
		rs.mode.Store("")
		select {
		case err := <-written:
			if err != nil {
				t.Fatalf("the write after a refusal (%s): %v", mode, err)
			}
		case <-time.After(10 * time.Second):
			t.Fatalf("the write did not land after the refusal (%s) ended", mode)
		}
	}

	// Superseded: the end.
	rs.mode.Store("superseded")
	start := time.Now()
	rs.drop(t)
	written := make(chan error, 1)
	go func() {
		_, err := rg.client.WriteAt(data, 16384)
		written <- err
	}()
	select {
	case err := <-written:
		// The write gets EIO when it reached the relay before the refusal;
		// after it, the relay has ended and closed the local side, which
		// the kernel takes as a dead device.
		var nerr *nbd.Error
		eio := errors.As(err, &nerr) && nerr.Errno == nbd.EIO
		if !eio && !errors.Is(err, nbd.ErrClosed) {
			t.Fatalf("the write after the refusal as superseded: %v, want an EIO reply or the local side closed", err)
		}
		t.Logf("%v %v after the grant was revoked", err, time.Since(start).Round(time.Millisecond))
	case <-time.After(10 * time.Second):
		t.Fatal("the write still waits 10 s after the server refused the export as superseded: the relay keeps redialing")
	}
	if err := rg.wait(10 * time.Second); !errors.Is(err, ErrFenced) || !errors.Is(err, nbd.ErrSuperseded) {
		t.Fatalf("Run returned %v, want ErrFenced", err)
	}
}
