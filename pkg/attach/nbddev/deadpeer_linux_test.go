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

package nbddev

import (
	"context"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mpnbd/mpnbd/pkg/attach"
)

// TestKernelSocketsCarryTheDeadPeerBound: every plain TCP socket handed
// to the kernel (tcp, multiconn) carries the dead-peer bound as
// TCP_USER_TIMEOUT with a keepalive, and the kernel's request timeout
// stays at least twice that bound: a socket to a silent storage host
// dies, and its unsent requests with it, before the kernel times them
// out and requeues them on another socket.
func TestKernelSocketsCarryTheDeadPeerBound(t *testing.T) {
	for _, c := range []struct {
		mode        attach.Transport
		o           attach.Options
		bound, reqT time.Duration
	}{
		{attach.TCP, attach.Options{}, attach.DefaultDeadPeerTimeout, attach.DefaultRequestTimeout},
		{attach.MultiConn, attach.Options{DeadPeerTimeout: 3 * time.Second}, 3 * time.Second, attach.DefaultRequestTimeout},
		{attach.MultiConn, attach.Options{DeadPeerTimeout: 8 * time.Second, RequestTimeout: 10 * time.Second}, 8 * time.Second, 16 * time.Second},
		{attach.TCP, attach.Options{RequestTimeout: 3 * time.Second}, 2 * time.Second, 4 * time.Second},
		{attach.TCP, attach.Options{RequestTimeout: 6 * time.Second}, 3 * time.Second, 6 * time.Second},
	} {
		t.Run(string(c.mode), func(t *testing.T) {
			a, k, _, _, tg := newTest(t, c.mode)
			k.holdSockets = true
			t.Cleanup(func() {
				for _, f := range k.held {
					f.Close()
				}
			})
			if _, err := a.Attach(context.Background(), tg, c.o); err != nil {
				t.Fatal(err)
			}
			k.mu.Lock()
			o := k.connects[0]
			held := k.held
			k.mu.Unlock()
			if o.Timeout != c.reqT {
				t.Errorf("kernel request timeout %v, want %v", o.Timeout, c.reqT)
			}
			if len(held) == 0 {
				t.Fatal("no socket handed to the kernel")
			}
			for _, f := range held {
				ut, err := unix.GetsockoptInt(int(f.Fd()), unix.IPPROTO_TCP, unix.TCP_USER_TIMEOUT)
				if err != nil {
					t.Fatal(err)
				}
				ka, err := unix.GetsockoptInt(int(f.Fd()), unix.SOL_SOCKET, unix.SO_KEEPALIVE)
				if err != nil {
					t.Fatal(err)
				}
				if time.Duration(ut)*time.Millisecond != c.bound || ka != 1 {
					t.Errorf("socket handed to the kernel: TCP_USER_TIMEOUT %d ms, SO_KEEPALIVE %d; want %v and on", ut, ka, c.bound)
				}
			}
		})
	}
}
