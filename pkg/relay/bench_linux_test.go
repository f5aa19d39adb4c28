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
	"fmt"
	"net"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/mpnbd/mpnbd/pkg/nbd"
)

// BenchmarkRelay compares our client talking to the server over loopback
// TCP directly ("direct") with the same client on the kernel's end of a
// socket pair through a relay ("relay"), and through a relay that keeps no
// acknowledged writes ("noretain"). Client, relay and server share the
// process, so cpu-ns/B (process CPU time, user + system, per byte moved;
// numerically CPU-seconds per GB) of relay minus direct is what the relay
// costs, and relay against noretain what keeping acknowledged writes until
// a flush covers them costs. "call" is the same session taking in-process
// calls (no socket pair: the fuse and ublk transports), so call against
// relay is what the in-process path costs. hack/bench-relay.sh prints the
// ratios.
func BenchmarkRelay(b *testing.B) {
	for _, op := range []string{"read", "write"} {
		for _, bs := range []int{4 << 10, 1 << 20} {
			for _, qd := range []int{8, 32} {
				for _, mode := range []string{"direct", "relay", "noretain", "call"} {
					if mode == "noretain" && op == "read" {
						continue // reads are not retained
					}
					name := fmt.Sprintf("%s/%dK/qd%d/%s", op, bs>>10, qd, mode)
					b.Run(name, func(b *testing.B) {
						benchmarkRelay(b, mode, op == "write", bs, qd)
					})
				}
			}
		}
	}
}

func cpuTime() time.Duration {
	var ru syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru) // fails only for a bad pointer
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

func benchmarkRelay(b *testing.B, mode string, write bool, bs, qd int) {
	const size = 256 << 20
	srv := &nbd.Server{Logger: quietLogger()}
	if err := srv.AddExport(&nbd.Export{Name: exportName, Backend: nbd.NewMemBackend(size)}); err != nil {
		b.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	go srv.Serve(ln)
	defer srv.Shutdown(context.Background())
	addr := ln.Addr().String()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()

	var cl *nbd.Client
	switch mode {
	case "call":
		remote, info, err := dialNegotiated(ctx, addr, false)
		if err != nil {
			b.Fatal(err)
		}
		r := New(nil, remote, negotiatingDialer(addr, false), Options{Logger: quietLogger()})
		done := make(chan struct{})
		go func() {
			defer close(done)
			_ = r.Run(ctx) // ended by the cancel below
		}()
		defer func() { cancel(); <-done }()
		cl = nbd.NewClientOn(info, r, quietLogger())
	case "relay", "noretain":
		remote, info, err := dialNegotiated(ctx, addr, false)
		if err != nil {
			b.Fatal(err)
		}
		kf, local, err := NewSocketPair()
		if err != nil {
			b.Fatal(err)
		}
		kc, err := net.FileConn(kf)
		kf.Close()
		if err != nil {
			b.Fatal(err)
		}
		r := New(local, remote, negotiatingDialer(addr, false), Options{Logger: quietLogger(), noRetain: mode == "noretain"})
		done := make(chan struct{})
		go func() {
			defer close(done)
			_ = r.Run(ctx) // ended by the cancel below
		}()
		defer func() { cancel(); <-done }()
		cl = nbd.NewClient(info, []net.Conn{kc}, quietLogger())
	default:
		cl, err = nbd.Dial(ctx, nbd.DialOptions{Addr: addr, Export: exportName, Logger: quietLogger()})
		if err != nil {
			b.Fatal(err)
		}
	}
	defer cl.Close()

	run := func(n int64) {
		var next atomic.Int64
		var wg sync.WaitGroup
		for w := 0; w < qd; w++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				buf := make([]byte, bs)
				for {
					i := next.Add(1) - 1
					if i >= n {
						return
					}
					off := (i * int64(bs)) % (size - int64(bs))
					off -= off % int64(bs)
					var err error
					if write {
						_, err = cl.WriteAt(buf, off)
					} else {
						_, err = cl.ReadAt(buf, off)
					}
					if err != nil {
						b.Error(err)
						return
					}
				}
			}()
		}
		wg.Wait()
	}
	run(int64(qd * 4)) // warm the pools and the connections
	b.SetBytes(int64(bs))
	b.ResetTimer()
	cpu0 := cpuTime()
	run(int64(b.N))
	cpu := cpuTime() - cpu0
	b.StopTimer()
	b.ReportMetric(float64(cpu.Nanoseconds())/(float64(b.N)*float64(bs)), "cpu-ns/B")
}
