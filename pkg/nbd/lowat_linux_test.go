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
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"net"
	"os"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mpnbd/mpnbd/pkg/mptcp"
)

// lowatPair returns the two ends of a loopback connection, MPTCP when
// multipath, the accepted one with its receive buffer fixed at rcvbuf
// bytes (0: left to the kernel).
func lowatPair(t *testing.T, multipath bool, rcvbuf int) (client, server net.Conn) {
	t.Helper()
	l, err := mptcp.Listen(context.Background(), "tcp", "127.0.0.1:0", multipath)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	acc := make(chan net.Conn, 1)
	go func() {
		c, err := l.Accept()
		if err != nil {
			t.Error(err)
		}
		acc <- c
	}()
	client, err = mptcp.Dialer(multipath).Dial("tcp", l.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { client.Close() })
	server = <-acc
	if server == nil {
		t.FailNow()
	}
	t.Cleanup(func() { server.Close() })
	if multipath && !IsMultipathTCP(server) {
		t.Skip("skipping: the connection fell back to TCP")
	}
	if rcvbuf > 0 {
		rc, err := server.(syscall.Conn).SyscallConn()
		if err != nil {
			t.Fatal(err)
		}
		var serr error
		if err := rc.Control(func(fd uintptr) {
			serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_RCVBUF, rcvbuf)
		}); err != nil || serr != nil {
			t.Fatal(err, serr)
		}
	}
	return client, server
}

// TestLowatMarkOutOfReach sends part of a payload and no more until the
// reader has it, the way a sender whose window is closed must wait: a read
// waiting for a low-water mark above what was sent would wait forever, so
// the guard must give up on the mark, and the bytes must be intact.
func TestLowatMarkOutOfReach(t *testing.T) {
	for _, multipath := range []bool{false, true} {
		name := "tcp"
		if multipath {
			name = "mptcp"
			if err := mptcp.Available(); err != nil {
				t.Logf("skipping mptcp: %v", err)
				continue
			}
		}
		t.Run(name, func(t *testing.T) {
			client, server := lowatPair(t, multipath, 0)
			lc := newLowatConn(server)
			const payload, part = 1 << 20, 100 << 10
			want := make([]byte, payload)
			rand.Read(want)
			gotPart := make(chan struct{})
			go func() {
				// After the reader waits: a mark only delays readiness,
				// bytes already there are read at once.
				time.Sleep(30 * time.Millisecond)
				if _, err := client.Write(want[:part]); err != nil {
					t.Error(err)
					return
				}
				select {
				case <-gotPart:
					if _, err := client.Write(want[part:]); err != nil {
						t.Error(err)
					}
				case <-time.After(10 * time.Second):
				}
			}()
			got := make([]byte, payload)
			done := make(chan error, 1)
			go func() {
				lc.expect(payload)
				signalled := false
				for n := 0; n < payload; {
					m, err := lc.Read(got[n:])
					if err != nil {
						done <- err
						return
					}
					if n += m; n >= part && !signalled {
						close(gotPart)
						signalled = true
					}
				}
				done <- nil
			}()
			select {
			case err := <-done:
				if err != nil {
					t.Fatal(err)
				}
			case <-time.After(10 * time.Second):
				server.Close()
				t.Fatalf("a read waited 10 s for a low-water mark of %d bytes with %d sent", lc.cur, part)
			}
			if !bytes.Equal(got, want) {
				t.Fatal("data read differs from data sent")
			}
			if lc.rc != nil && lc.stalls != 1 {
				t.Errorf("%d stalls counted, want 1", lc.stalls)
			}
		})
	}
}

// TestLowatDrain drains a connection whose reader waits for its mark: the
// read ends with the deadline error instead of going on without the mark.
func TestLowatDrain(t *testing.T) {
	client, server := lowatPair(t, false, 0)
	var draining atomic.Bool
	lc := newLowatConn(server)
	lc.stopping = draining.Load
	if _, err := client.Write(make([]byte, 1000)); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() {
		lc.expect(1 << 20)
		buf := make([]byte, 1<<20)
		var err error
		for n, m := 0, 0; err == nil && n < len(buf); n += m {
			m, err = lc.Read(buf[n:])
		}
		done <- err
	}()
	time.Sleep(20 * time.Millisecond)
	draining.Store(true)
	server.SetReadDeadline(time.Now())
	select {
	case err := <-done:
		if !errors.Is(err, os.ErrDeadlineExceeded) {
			t.Fatalf("read of a drained connection: %v, want the deadline error", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("read of a drained connection still waits after 10 s")
	}
}
