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

package bench

import (
	"bytes"
	"context"
	"io"
	"log/slog"
	"net"
	"sync/atomic"
	"testing"
	"time"

	"github.com/mpnbd/mpnbd/pkg/nbd"
)

// serve runs an in-process NBD server with one export on loopback TCP
// and returns its address.
func serve(t *testing.T, b nbd.Backend) string {
	t.Helper()
	s := &nbd.Server{Logger: slog.New(slog.NewTextHandler(io.Discard, nil))}
	if err := s.AddExport(&nbd.Export{Name: "bench", Backend: b}); err != nil {
		t.Fatal(err)
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go s.Serve(l)
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		s.Shutdown(ctx)
		l.Close()
	})
	return l.Addr().String()
}

func TestRunLoadPatterns(t *testing.T) {
	addr := serve(t, nbd.NewMemBackend(8<<20))
	for _, rw := range []string{"read", "write", "randread", "randwrite"} {
		t.Run(rw, func(t *testing.T) {
			rep, err := RunLoad(context.Background(), LoadConfig{
				Addr: addr, Export: "bench", RW: rw, BlockSize: 64 << 10, QueueDepth: 4,
				Duration: 150 * time.Millisecond, Warmup: 20 * time.Millisecond, Span: 1<<20 + 100,
			})
			if err != nil {
				t.Fatal(err)
			}
			if !rep.OK() || rep.Problem() != "" {
				t.Fatalf("run failed: %s (%+v)", rep.Problem(), rep)
			}
			if rep.Span != 1<<20 || rep.ExportSize != 8<<20 || rep.Bytes != rep.Ops*64<<10 || rep.Seconds <= 0 || rep.MBps <= 0 || rep.IOPS <= 0 {
				t.Errorf("report %+v", rep)
			}
			if len(rep.MPTCP) != 1 || rep.MPTCP[0] || len(rep.Subflows) != 1 || rep.Subflows[0] != 0 {
				t.Errorf("plain TCP run reports mptcp %v subflows %v", rep.MPTCP, rep.Subflows)
			}
			if rep.CPUSeconds <= 0 {
				t.Errorf("no CPU time reported")
			}
		})
	}
}

// spyBackend records the highest offset touched and can corrupt reads.
type spyBackend struct {
	*nbd.MemBackend
	maxEnd  atomic.Int64
	corrupt atomic.Int64 // flip a byte of reads covering this offset (-1: never)
	failAt  atomic.Int64 // fail writes at this offset (-1: never)
}

func newSpy(size int64) *spyBackend {
	s := &spyBackend{MemBackend: nbd.NewMemBackend(size)}
	s.corrupt.Store(-1)
	s.failAt.Store(-1)
	return s
}

func (s *spyBackend) note(n int, off int64) {
	for {
		cur := s.maxEnd.Load()
		if off+int64(n) <= cur || s.maxEnd.CompareAndSwap(cur, off+int64(n)) {
			return
		}
	}
}

func (s *spyBackend) ReadAt(p []byte, off int64) (int, error) {
	s.note(len(p), off)
	n, err := s.MemBackend.ReadAt(p, off)
	if c := s.corrupt.Load(); c >= off && c < off+int64(len(p)) {
		p[c-off] ^= 0xff
	}
	return n, err
}

func (s *spyBackend) WriteAt(p []byte, off int64) (int, error) {
	s.note(len(p), off)
	if f := s.failAt.Load(); f >= off && f < off+int64(len(p)) {
		return 0, io.ErrUnexpectedEOF
	}
	return s.MemBackend.WriteAt(p, off)
}

func TestRunLoadStaysInSpan(t *testing.T) {
	spy := newSpy(4 << 20)
	addr := serve(t, spy)
	for _, rw := range []string{"read", "randwrite"} {
		rep, err := RunLoad(context.Background(), LoadConfig{
			Addr: addr, Export: "bench", RW: rw, BlockSize: 4096, QueueDepth: 8, Duration: 100 * time.Millisecond, Span: 64 << 10,
		})
		if err != nil || !rep.OK() {
			t.Fatalf("%s: %v %+v", rw, err, rep)
		}
		// Sequential runs wrap: far more bytes than the span moved.
		if rw == "read" && rep.Bytes <= 64<<10 {
			t.Logf("only %d bytes read; wrap-around not exercised", rep.Bytes)
		}
	}
	if got := spy.maxEnd.Load(); got > 64<<10 {
		t.Fatalf("requests reached offset %d beyond the 64 KiB span", got)
	}
}

func TestRunLoadVerify(t *testing.T) {
	spy := newSpy(4 << 20)
	addr := serve(t, spy)
	cfg := LoadConfig{Addr: addr, Export: "bench", RW: "randwrite", BlockSize: 16 << 10, QueueDepth: 8, Verify: true, Span: 1 << 20, Seed: 42}
	rep, err := RunLoad(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	if !rep.OK() || rep.VerifiedBytes != 1<<20 || rep.Mismatches != 0 || rep.Bytes != 2<<20 {
		t.Fatalf("clean verify: %+v", rep)
	}
	// The data really is the pattern.
	want := make([]byte, 16<<10)
	FillPattern(want, 42, 5*16<<10)
	got := make([]byte, len(want))
	if _, err := spy.MemBackend.ReadAt(got, 5*16<<10); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) {
		t.Fatal("backend does not hold the pattern")
	}

	spy.corrupt.Store(300_000)
	cfg.RW = "write"
	rep, err = RunLoad(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	if rep.OK() || rep.Mismatches != 1 || rep.FirstMismatch == nil || *rep.FirstMismatch != 300_000/(16<<10)*(16<<10) {
		t.Fatalf("corrupted read not detected: %+v", rep)
	}
	if p := rep.Problem(); p == "" {
		t.Fatal("no problem reported")
	}

	spy.corrupt.Store(-1)
	spy.failAt.Store(100_000)
	rep, err = RunLoad(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	if rep.OK() || rep.Errors == 0 || rep.FirstError == "" {
		t.Fatalf("write error not reported: %+v", rep)
	}
}

func TestRunLoadErrors(t *testing.T) {
	spy := newSpy(1 << 20)
	addr := serve(t, spy)
	spy.failAt.Store(0)
	rep, err := RunLoad(context.Background(), LoadConfig{Addr: addr, Export: "bench", RW: "write", BlockSize: 4096, QueueDepth: 4, Duration: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	// The first failure stops the run early.
	if rep.OK() || rep.Errors == 0 {
		t.Fatalf("%+v", rep)
	}

	bad := []LoadConfig{
		{Addr: "", RW: "read", BlockSize: 4096, QueueDepth: 1, Duration: time.Second},
		{Addr: addr, RW: "mixed", BlockSize: 4096, QueueDepth: 1, Duration: time.Second},
		{Addr: addr, RW: "read", BlockSize: 1000, QueueDepth: 1, Duration: time.Second},
		{Addr: addr, RW: "read", BlockSize: 4096, QueueDepth: 0, Duration: time.Second},
		{Addr: addr, RW: "read", BlockSize: 4096, QueueDepth: 1},
		{Addr: addr, Export: "bench", RW: "read", BlockSize: 2 << 20, QueueDepth: 1, Duration: time.Second}, // block > export
		{Addr: addr, Export: "nope", RW: "read", BlockSize: 4096, QueueDepth: 1, Duration: time.Second},
	}
	for i, cfg := range bad {
		if _, err := RunLoad(context.Background(), cfg); err == nil {
			t.Errorf("config %d accepted: %+v", i, cfg)
		}
	}
}

func TestFillPattern(t *testing.T) {
	// The pattern depends on the absolute offset only.
	a := make([]byte, 8192)
	FillPattern(a, 7, 4096)
	b := make([]byte, 4096)
	FillPattern(b, 7, 8192)
	if !bytes.Equal(a[4096:], b) {
		t.Fatal("pattern differs between block sizes")
	}
	c := make([]byte, 4096)
	FillPattern(c, 8, 8192)
	if bytes.Equal(b, c) {
		t.Fatal("seed ignored")
	}
}
