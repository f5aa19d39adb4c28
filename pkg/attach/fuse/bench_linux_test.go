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

package fuse

import (
	"context"
	"crypto/rand"
	"net"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mpnbd/mpnbd/pkg/attach"
	"github.com/mpnbd/mpnbd/pkg/nbd"
)

const (
	benchBlock = 1 << 20
	benchSize  = 1 << 30
)

// benchSeq moves b.N blocks of 1 MiB with qd workers taking consecutive
// offsets (qd 1 is dd with bs=1M).
func benchSeq(b *testing.B, qd int, op func(buf []byte, off int64) error) {
	b.SetBytes(benchBlock)
	var next atomic.Int64
	var wg sync.WaitGroup
	var firstErr atomic.Pointer[error]
	b.ResetTimer()
	for w := 0; w < qd; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			buf := alignedBuf(benchBlock)
			rand.Read(buf)
			for {
				i := next.Add(1) - 1
				if i >= int64(b.N) {
					return
				}
				off := i * benchBlock % benchSize
				if err := op(buf, off); err != nil {
					firstErr.CompareAndSwap(nil, &err)
					return
				}
			}
		}()
	}
	wg.Wait()
	b.StopTimer()
	if p := firstErr.Load(); p != nil {
		b.Fatal(*p)
	}
}

// benchRand moves b.N random 4 KiB blocks with qd workers over the
// first benchRandSpan bytes (fio's randread/randwrite with bs=4k).
func benchRand(b *testing.B, qd int, op func(buf []byte, off int64) error) {
	b.SetBytes(benchRandBlock)
	var next atomic.Int64
	var wg sync.WaitGroup
	var firstErr atomic.Pointer[error]
	b.ResetTimer()
	for w := 0; w < qd; w++ {
		wg.Add(1)
		go func(seed uint64) {
			defer wg.Done()
			buf := alignedBuf(benchRandBlock)
			rand.Read(buf)
			x := seed*0x9e3779b97f4a7c15 + 1
			for next.Add(1) <= int64(b.N) {
				// xorshift: cheap and without a lock between workers.
				x ^= x << 13
				x ^= x >> 7
				x ^= x << 17
				off := int64(x%(benchRandSpan/benchRandBlock)) * benchRandBlock
				if err := op(buf, off); err != nil {
					firstErr.CompareAndSwap(nil, &err)
					return
				}
			}
		}(uint64(w))
	}
	wg.Wait()
	b.StopTimer()
	if p := firstErr.Load(); p != nil {
		b.Fatal(*p)
	}
}

const (
	benchRandBlock = 4 << 10
	benchRandSpan  = 128 << 20
)

// benchVariant is one FUSE configuration to measure.
type benchVariant struct {
	name string
	cfg  Config
}

// benchVariants are the settings compared; FUSE_BENCH_VARIANTS=all adds
// the alternatives to the chosen defaults.
func benchVariants() []benchVariant {
	v := []benchVariant{{name: "default"}}
	if os.Getenv("FUSE_BENCH_VARIANTS") == "all" {
		v = append(v,
			benchVariant{"maxwrite128k", Config{MaxWrite: 128 << 10}},
			benchVariant{"maxwrite256k", Config{MaxWrite: 256 << 10}},
			benchVariant{"bg12", Config{MaxBackground: 12}},
			benchVariant{"bg128", Config{MaxBackground: 128}},
			benchVariant{"syncdio", Config{syncDIO: true}},
			benchVariant{"bufferedloop", Config{bufferedLoop: true}},
			benchVariant{"cachedfile", Config{cachedFile: true}},
		)
	}
	return v
}

// BenchmarkThroughput measures sequential 1 MiB I/O over one MPTCP
// connection with a subflow on each of 4 paths (1 Gbit/s each): through
// the loop device with O_DIRECT (FUSE transport), and with the client's
// ReadAt/WriteAt directly, at queue depth 1 (dd bs=1M) and 8.
//
//	go test -run '^$' -bench Throughput -benchtime 2s ./pkg/attach/fuse/
func BenchmarkThroughput(b *testing.B) {
	requireFUSE(b)
	tp, ts, _ := fourPaths(b, "fb", benchSize)
	benchThroughput(b, tp.InClient, inClientServe(b, tp), ts.addr, 4)
}

// BenchmarkThroughputLoopback is BenchmarkThroughput over the unshaped
// loopback interface (one subflow), where the CPU cost of each layer,
// not the paths, sets the pace.
func BenchmarkThroughputLoopback(b *testing.B) {
	requireFUSE(b)
	ts := localServer(b, benchSize)
	benchThroughput(b, nil, nil, ts.addr, 1)
}

// benchThroughput compares the raw client with the FUSE device; the raw
// client dials inside in (nil: here), and the server processes run serve
// (nil: the default ServeCommand), which must dial from where in does.
func benchThroughput(b *testing.B, in func(func() error) error, serve []string, addr string, subflows int) {
	ctx := context.Background()
	if in == nil {
		in = func(fn func() error) error { return fn() }
	}
	var c net.Conn
	var info nbd.ExportInfo
	err := in(func() (err error) {
		c, info, err = attach.ExportDialer{}.DialExport(ctx, addr, "", "vol", true, nil)
		return err
	})
	if err != nil {
		b.Fatal(err)
	}
	cl := nbd.NewClient(info, []net.Conn{c}, nil)
	b.Cleanup(func() { cl.Close() })
	warm := alignedBuf(benchBlock)
	for off := int64(0); off < 128<<20; off += benchBlock {
		if _, err := cl.WriteAt(warm, off); err != nil {
			b.Fatal(err)
		}
	}

	for _, qd := range []int{1, 8} {
		qs := "qd" + string(rune('0'+qd))
		b.Run("client/write-"+qs, func(b *testing.B) {
			benchSeq(b, qd, func(buf []byte, off int64) error { _, err := cl.WriteAt(buf, off); return err })
		})
		b.Run("client/read-"+qs, func(b *testing.B) {
			benchSeq(b, qd, func(buf []byte, off int64) error { _, err := cl.ReadAt(buf, off); return err })
		})
	}

	for _, v := range benchVariants() {
		cfg := v.cfg
		cfg.ServeCommand = serve
		a := newAttacher(b, cfg)
		id := "pv-bench-" + v.name
		att, err := a.Attach(ctx, target(id, addr), attach.Options{})
		if err != nil {
			b.Fatal(err)
		}
		f, err := os.OpenFile(att.Device, os.O_RDWR|unix.O_DIRECT, 0)
		if err != nil {
			b.Fatal(err)
		}
		// Bring the subflows up before measuring.
		for off := int64(0); off < 128<<20; off += benchBlock {
			if _, err := f.WriteAt(warm, off); err != nil {
				b.Fatal(err)
			}
		}
		deadline := time.Now().Add(5 * time.Second)
		for {
			h, _ := a.Health(id)
			if len(h.Subflows) == 1 && h.Subflows[0] >= subflows || time.Now().After(deadline) {
				break
			}
			time.Sleep(50 * time.Millisecond)
		}
		for _, qd := range []int{1, 8} {
			qs := "qd" + string(rune('0'+qd))
			name := "fuse-loop"
			if v.name != "default" {
				name += "-" + v.name
			}
			b.Run(name+"/write-"+qs, func(b *testing.B) {
				benchSeq(b, qd, func(buf []byte, off int64) error { _, err := f.WriteAt(buf, off); return err })
			})
			b.Run(name+"/read-"+qs, func(b *testing.B) {
				benchSeq(b, qd, func(buf []byte, off int64) error { _, err := f.ReadAt(buf, off); return err })
			})
		}
		for _, qd := range []int{1, 16} {
			qs := "qd" + strconv.Itoa(qd)
			name := "fuse-loop"
			if v.name != "default" {
				name += "-" + v.name
			}
			b.Run(name+"/randwrite4k-"+qs, func(b *testing.B) {
				benchRand(b, qd, func(buf []byte, off int64) error { _, err := f.WriteAt(buf, off); return err })
			})
			b.Run(name+"/randread4k-"+qs, func(b *testing.B) {
				benchRand(b, qd, func(buf []byte, off int64) error { _, err := f.ReadAt(buf, off); return err })
			})
		}
		f.Close()
		if err := a.Detach(ctx, id); err != nil {
			b.Fatal(err)
		}
	}
}
