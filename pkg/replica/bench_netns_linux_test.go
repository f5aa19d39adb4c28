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

package replica

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/mpnbd/mpnbd/internal/testenv/topo"
	"github.com/mpnbd/mpnbd/pkg/mptcp"
	"github.com/mpnbd/mpnbd/pkg/nbd"
)

// benchPathMbit is the rate of each of the 4 paths of both links in
// BenchmarkMirror: low enough that two cores carry both links at line
// rate, so the paths and not the CPU bound what each case moves.
const benchPathMbit = 200

// BenchmarkMirror compares, on the same shaped paths in one run, a client
// writing and reading a volume on a primary that forwards every change to
// one replica ("replicated") with the same client on the same primary
// serving an unreplicated volume ("single"). The client reaches the
// primary over 4 MPTCP paths, the primary the replica over 4 paths of its
// own (storage to storage), each benchPathMbit. Besides MB/s it reports
// line-MB/s (what the client's paths carry) and cpu-ns/B (process CPU per
// byte; client, primary and replica share the process).
// hack/bench-replica.sh prints the ratios.
func BenchmarkMirror(b *testing.B) {
	topo.RequireRoot(b)
	if err := mptcp.Available(); err != nil {
		b.Skipf("skipping: MPTCP unavailable: %v", err)
	}
	const size = 256 << 20
	front := topo.NewForTest(b, topo.Uniform(topo.UniqueName("bf"), 4, benchPathMbit))
	back := topo.NewForTest(b, topo.Uniform(topo.UniqueName("bb"), 4, benchPathMbit))
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))

	// The replica, on the far side of the storage-to-storage paths.
	replicaSrv := &nbd.Server{Logger: quiet}
	if err := replicaSrv.AddExport(&nbd.Export{Name: "r", Backend: nbd.NewMemBackend(size)}); err != nil {
		b.Fatal(err)
	}
	serveIn(b, back.InServer, net.JoinHostPort(back.ServerAddr(1).String(), "10809"), replicaSrv)
	var forward *nbd.Client
	if err := back.InClient(func() error {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		var err error
		forward, err = nbd.Dial(ctx, nbd.DialOptions{Addr: net.JoinHostPort(back.ServerAddr(1).String(), "10809"), Export: "r", MPTCP: true, Logger: quiet})
		return err
	}); err != nil {
		b.Fatal(err)
	}
	m, err := New(Config{Local: nbd.NewMemBackend(size), Peers: map[string]Peer{"r": forward}, Epoch: 1,
		Arbiter: &fakeArbiter{epoch: 1}, Logger: quiet})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { m.Close() })

	// The primary, serving both volumes to the client.
	primary := &nbd.Server{Logger: quiet}
	for name, be := range map[string]nbd.Backend{"single": nbd.NewMemBackend(size), "replicated": m} {
		if err := primary.AddExport(&nbd.Export{Name: name, Backend: be}); err != nil {
			b.Fatal(err)
		}
	}
	addr := net.JoinHostPort(front.ServerAddr(1).String(), "10809")
	serveIn(b, front.InServer, addr, primary)

	for _, c := range []struct {
		op        string
		bs, qd    int
		random    bool
		writeOnly bool
	}{
		{"write", 1 << 20, 8, false, true},
		{"read", 1 << 20, 8, false, false},
		{"randwrite", 4 << 10, 32, true, true},
	} {
		for _, vol := range []string{"single", "replicated"} {
			b.Run(fmt.Sprintf("%s/%dK/qd%d/%s", c.op, c.bs>>10, c.qd, vol), func(b *testing.B) {
				var cl *nbd.Client
				if err := front.InClient(func() error {
					ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
					defer cancel()
					var err error
					cl, err = nbd.Dial(ctx, nbd.DialOptions{Addr: addr, Export: vol, MPTCP: true, Logger: quiet})
					return err
				}); err != nil {
					b.Fatal(err)
				}
				defer cl.Close()
				runLoad(b, cl, size, c.bs, c.qd, c.random, c.writeOnly)
				b.ReportMetric(front.LineRateMBps(), "line-MB/s")
			})
		}
	}
}

// serveIn serves srv on an MPTCP listener at addr made in a namespace
// (in runs a function there); the benchmark's end stops it.
func serveIn(b *testing.B, in func(func() error) error, addr string, srv *nbd.Server) {
	b.Helper()
	var ln net.Listener
	if err := in(func() error {
		var err error
		ln, err = mptcp.Listen(context.Background(), "tcp4", addr, true)
		return err
	}); err != nil {
		b.Fatal(err)
	}
	go func() { _ = srv.Serve(ln) }()
	b.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = srv.Shutdown(ctx)
	})
}

// runLoad moves b.N requests of bs bytes with qd in flight, sequential or
// at random offsets, and reports cpu-ns/B.
func runLoad(b *testing.B, cl *nbd.Client, size int64, bs, qd int, random, write bool) {
	b.SetBytes(int64(bs))
	blocks := size / int64(bs)
	var next sync.Mutex
	i := int64(0)
	offset := func() (int64, bool) {
		next.Lock()
		defer next.Unlock()
		if i >= int64(b.N) {
			return 0, false
		}
		k := i % blocks
		if random {
			k = rand.Int64N(blocks)
		}
		i++
		return k * int64(bs), true
	}
	cpu0 := cpuTime()
	b.ResetTimer()
	var wg sync.WaitGroup
	for range qd {
		wg.Add(1)
		go func() {
			defer wg.Done()
			buf := make([]byte, bs)
			for {
				off, ok := offset()
				if !ok {
					return
				}
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
	b.StopTimer()
	b.ReportMetric(float64(cpuTime()-cpu0)/float64(int64(b.N)*int64(bs)), "cpu-ns/B")
}

func cpuTime() time.Duration {
	var ru syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru) // fails only for a bad pointer
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// BenchmarkRebuild times rebuilds over the storage-to-storage paths (4
// paths of benchPathMbit): a full copy of a volume whose every chunk
// holds data ("full/dense"), a full copy of one with a tenth of its
// chunks written and the rest never written ("full/sparse10": the chunks
// of zeroes go as WRITE_ZEROES), and the catch-up of a replica that missed
// writes to a tenth of the chunks while it was away ("catchup10"). It
// reports the volume's bytes per second of rebuild (vol-MB/s), the data
// bytes per second sent (data-MB/s) and the paths' line rate; the time
// of one rebuild is ns/op. hack/bench-replica.sh prints them against the
// line rate.
func BenchmarkRebuild(b *testing.B) {
	topo.RequireRoot(b)
	if err := mptcp.Available(); err != nil {
		b.Skipf("skipping: MPTCP unavailable: %v", err)
	}
	const size = 256 << 20
	back := topo.NewForTest(b, topo.Uniform(topo.UniqueName("br"), 4, benchPathMbit))
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))
	replicaSrv := &nbd.Server{Logger: quiet}
	if err := replicaSrv.AddExport(&nbd.Export{Name: "r", Backend: nbd.NewMemBackend(size)}); err != nil {
		b.Fatal(err)
	}
	addr := net.JoinHostPort(back.ServerAddr(1).String(), "10809")
	serveIn(b, back.InServer, addr, replicaSrv)
	dial := func() *nbd.Client {
		b.Helper()
		var cl *nbd.Client
		if err := back.InClient(func() error {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			var err error
			cl, err = nbd.Dial(ctx, nbd.DialOptions{Addr: addr, Export: "r", MPTCP: true, Logger: quiet})
			return err
		}); err != nil {
			b.Fatal(err)
		}
		return cl
	}
	// fill writes random data to every chunk, or to one in ten.
	fill := func(be nbd.Backend, every int) int64 {
		buf := make([]byte, Chunk)
		var n int64
		for off := int64(0); off < size; off += Chunk {
			if (off/Chunk)%int64(every) != 0 {
				continue
			}
			for i := range buf {
				buf[i] = byte(rand.Uint32())
			}
			if _, err := be.WriteAt(buf, off); err != nil {
				b.Fatal(err)
			}
			n += Chunk
		}
		return n
	}
	report := func(b *testing.B, data int64) {
		s := b.Elapsed().Seconds() / float64(b.N)
		b.ReportMetric(float64(size)/1e6/s, "vol-MB/s")
		b.ReportMetric(float64(data)/1e6/s, "data-MB/s")
		b.ReportMetric(back.LineRateMBps(), "line-MB/s")
	}
	for _, every := range []int{1, 10} {
		name := "full/dense"
		if every > 1 {
			name = "full/sparse10"
		}
		b.Run(name, func(b *testing.B) {
			local := nbd.NewMemBackend(size)
			data := fill(local, every)
			b.ResetTimer()
			for range b.N {
				b.StopTimer()
				m, err := New(Config{Local: local, Out: []string{"r"}, Epoch: 1, Arbiter: &fakeArbiter{epoch: 1, drops: []string{"r"}}, Logger: quiet})
				if err != nil {
					b.Fatal(err)
				}
				cl := dial()
				b.StartTimer()
				if err := m.Rebuild(context.Background(), "r", cl, RebuildOptions{}); err != nil {
					b.Fatal(err)
				}
				b.StopTimer()
				m.Close()
				b.StartTimer()
			}
			report(b, data)
		})
	}
	b.Run("catchup10", func(b *testing.B) {
		local := nbd.NewMemBackend(size)
		fill(local, 1)
		var data int64
		b.ResetTimer()
		for range b.N {
			b.StopTimer()
			// In sync, then away (its connection gone) while a tenth of
			// the chunks change.
			away := dial()
			m, err := New(Config{Local: local, Out: []string{"r"}, Epoch: 1, Arbiter: &fakeArbiter{epoch: 1, drops: []string{"r"}}, Logger: quiet})
			if err != nil {
				b.Fatal(err)
			}
			if err := m.Rebuild(context.Background(), "r", away, RebuildOptions{}); err != nil {
				b.Fatal(err)
			}
			away.Close()
			data = fill(m, 10)
			if got := m.Lacking("r").Bytes(); got != data {
				b.Fatalf("the replica lacks %d bytes, want the %d written while it was away", got, data)
			}
			cl := dial()
			b.StartTimer()
			if err := m.Rebuild(context.Background(), "r", cl, RebuildOptions{}); err != nil {
				b.Fatal(err)
			}
			b.StopTimer()
			m.Close()
			b.StartTimer()
		}
		report(b, data)
	})
}

// BenchmarkRebuildForeground measures what a full rebuild leaves to the
// volume's own writes: a client writes 1 MiB blocks at QD8 for a few
// seconds to a replicated volume whose replica is in sync ("alone"), then
// to the same kind of volume while its replica is being rebuilt whole
// ("rebuilding": the rebuild's copy and the forwards of the client's
// writes share the storage-to-storage paths). It reports the client's
// MB/s (fg-MB/s) and, while rebuilding, the rebuild's copy rate
// (copy-MB/s); hack/bench-replica.sh prints the ratio of the two fg-MB/s.
func BenchmarkRebuildForeground(b *testing.B) {
	topo.RequireRoot(b)
	if err := mptcp.Available(); err != nil {
		b.Skipf("skipping: MPTCP unavailable: %v", err)
	}
	const size = 512 << 20
	const window = 3 * time.Second
	front := topo.NewForTest(b, topo.Uniform(topo.UniqueName("ff"), 4, benchPathMbit))
	back := topo.NewForTest(b, topo.Uniform(topo.UniqueName("fb"), 4, benchPathMbit))
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))
	replicaSrv := &nbd.Server{Logger: quiet}
	for _, name := range []string{"alone", "rebuilding"} {
		if err := replicaSrv.AddExport(&nbd.Export{Name: name, Backend: nbd.NewMemBackend(size)}); err != nil {
			b.Fatal(err)
		}
	}
	backAddr := net.JoinHostPort(back.ServerAddr(1).String(), "10809")
	serveIn(b, back.InServer, backAddr, replicaSrv)
	dialIn := func(in func(func() error) error, addr, export string) *nbd.Client {
		b.Helper()
		var cl *nbd.Client
		if err := in(func() error {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			var err error
			cl, err = nbd.Dial(ctx, nbd.DialOptions{Addr: addr, Export: export, MPTCP: true, Logger: quiet})
			return err
		}); err != nil {
			b.Fatal(err)
		}
		return cl
	}
	// Both volumes full of data: the rebuild copies every chunk.
	dense := func() *nbd.MemBackend {
		be := nbd.NewMemBackend(size)
		buf := make([]byte, 1<<20)
		for off := int64(0); off < size; off += int64(len(buf)) {
			for i := range buf {
				buf[i] = byte(rand.Uint32())
			}
			if _, err := be.WriteAt(buf, off); err != nil {
				b.Fatal(err)
			}
		}
		return be
	}
	alone, err := New(Config{Local: dense(), Peers: map[string]Peer{"r": dialIn(back.InClient, backAddr, "alone")}, Epoch: 1,
		Arbiter: &fakeArbiter{epoch: 1}, Logger: quiet})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { alone.Close() })
	primary := &nbd.Server{Logger: quiet}
	if err := primary.AddExport(&nbd.Export{Name: "alone", Backend: alone}); err != nil {
		b.Fatal(err)
	}
	frontAddr := net.JoinHostPort(front.ServerAddr(1).String(), "10809")
	serveIn(b, front.InServer, frontAddr, primary)

	// write writes 1 MiB blocks at QD8 for the window and returns MB/s.
	write := func(b *testing.B, cl *nbd.Client) float64 {
		var moved atomic.Int64
		end := time.Now().Add(window)
		start := time.Now()
		var wg sync.WaitGroup
		for q := range 8 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				// Data, not zeroes: a later run's rebuild copies them
				// as data.
				buf := make([]byte, 1<<20)
				for i := range buf {
					buf[i] = byte(rand.Uint32() | 1)
				}
				for off := int64(q) << 20; time.Now().Before(end); off = (off + 8<<20) % size {
					if _, err := cl.WriteAt(buf, off); err != nil {
						b.Error(err)
						return
					}
					moved.Add(int64(len(buf)))
				}
			}()
		}
		wg.Wait()
		return float64(moved.Load()) / 1e6 / time.Since(start).Seconds()
	}
	b.Run("alone", func(b *testing.B) {
		cl := dialIn(front.InClient, frontAddr, "alone")
		defer cl.Close()
		b.ReportMetric(write(b, cl), "fg-MB/s")
	})
	local := dense()
	runs := 0
	b.Run("rebuilding", func(b *testing.B) {
		// A volume of its own each run, its replica out.
		rebuilt, err := New(Config{Local: local, Out: []string{"r"}, Epoch: 1,
			Arbiter: &fakeArbiter{epoch: 1, drops: []string{"r"}}, Logger: quiet})
		if err != nil {
			b.Fatal(err)
		}
		defer rebuilt.Close()
		runs++
		name := fmt.Sprintf("rebuilding%d", runs)
		if err := primary.AddExport(&nbd.Export{Name: name, Backend: rebuilt}); err != nil {
			b.Fatal(err)
		}
		cl := dialIn(front.InClient, frontAddr, name)
		defer cl.Close()
		var copied atomic.Int64
		rebuildDone := make(chan error, 1)
		go func() {
			rebuildDone <- rebuilt.Rebuild(context.Background(), "r", dialIn(back.InClient, backAddr, "rebuilding"),
				RebuildOptions{Progress: func(c, _ int64) { copied.Store(c) }})
		}()
		for deadline := time.Now().Add(10 * time.Second); copied.Load() == 0; time.Sleep(time.Millisecond) {
			select {
			case err := <-rebuildDone:
				b.Fatalf("the rebuild ended before it copied anything: %v", err)
			default:
			}
			if time.Now().After(deadline) {
				b.Fatal("the rebuild copied nothing in 10 s")
			}
		}
		c0, t0 := copied.Load(), time.Now()
		fg := write(b, cl)
		copyRate := float64(copied.Load()-c0) / 1e6 / time.Since(t0).Seconds()
		if err := <-rebuildDone; err != nil {
			b.Fatal(err)
		}
		if copied.Load() != size {
			b.Fatalf("the rebuild copied %d bytes, want %d", copied.Load(), size)
		}
		b.ReportMetric(fg, "fg-MB/s")
		b.ReportMetric(copyRate, "copy-MB/s")
	})
}
