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
	"context"
	"crypto/tls"
	"encoding/binary"
	"errors"
	"fmt"
	"math/rand/v2"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/mpnbd/mpnbd/pkg/mptcp"
	"github.com/mpnbd/mpnbd/pkg/nbd"
)

// LoadConfig describes one run of the load generator (nbdload).
type LoadConfig struct {
	Addr   string // HOST:PORT of the NBD server
	Export string // export name
	MPTCP  bool   // dial with Multipath TCP
	Conns  int    // NBD connections (1 unless set)
	// TLS, when set, upgrades the connections with STARTTLS.
	TLS *tls.Config

	// RW is the access pattern: read, write, randread or randwrite.
	RW string
	// BlockSize is the size of every request in bytes.
	BlockSize int
	// QueueDepth is the number of concurrent workers, i.e. requests in
	// flight, sharing the one client.
	QueueDepth int
	// Duration is the measured time; Warmup runs before it and is not
	// counted.
	Duration, Warmup time.Duration
	// MeasureFrom, when set, starts the measured window at that instant
	// instead of after Warmup: clients started together measure the same
	// window, so their rates add up. A client whose load starts later
	// reports an error.
	MeasureFrom time.Time
	// Span limits offsets to [0, Span); 0 means the whole export. It is
	// rounded down to a multiple of BlockSize.
	Span int64
	// Seed makes random offsets and data reproducible (0: random).
	Seed uint64

	// Verify replaces the timed run by a correctness pass: write a
	// pattern over the span, read it back and compare.
	Verify bool
}

// LoadReport is what nbdload prints, as one JSON object.
type LoadReport struct {
	Addr       string `json:"addr"`
	Export     string `json:"export"`
	RW         string `json:"rw"`
	BlockSize  int    `json:"bs"`
	QueueDepth int    `json:"qd"`
	Span       int64  `json:"span"`

	// Bytes and Ops completed during the measured window of Seconds.
	Bytes   int64   `json:"bytes"`
	Ops     int64   `json:"ops"`
	Seconds float64 `json:"seconds"`
	// WindowStart is when the measured window began.
	WindowStart time.Time `json:"window_start"`
	MBps        float64   `json:"mb_per_s"` // 10^6 bytes per second
	IOPS        float64   `json:"iops"`

	// MPTCP reports, per connection, whether it is carried by MPTCP.
	MPTCP []bool `json:"mptcp"`
	// Subflows is, per connection, the number of established subflows
	// (MPTCP_INFO, initial one included) at the end of the measurement;
	// SubflowsMax the largest number seen while running. 0 for TCP.
	Subflows    []int `json:"subflows"`
	SubflowsMax []int `json:"subflows_max"`

	// CPU time of the whole nbdload process (getrusage), from start to
	// the end of the run, and during the measured window only.
	CPUSeconds       float64 `json:"client_cpu_s"`
	UserSeconds      float64 `json:"client_user_s"`
	SysSeconds       float64 `json:"client_sys_s"`
	WindowCPUSeconds float64 `json:"client_cpu_window_s"`

	Errors     int64  `json:"errors"`
	FirstError string `json:"first_error,omitempty"`

	// Verify mode only.
	Verify         bool    `json:"verify,omitempty"`
	VerifiedBytes  int64   `json:"verified_bytes,omitempty"`
	Mismatches     int64   `json:"mismatches,omitempty"`
	FirstMismatch  *int64  `json:"first_mismatch_offset,omitempty"`
	ExportSize     int64   `json:"export_size"`
	ConnectSeconds float64 `json:"connect_s"`
}

// OK reports whether the run moved data without errors (and, in verify
// mode, without mismatches).
func (r *LoadReport) OK() bool {
	return r.Errors == 0 && r.Mismatches == 0 && r.Bytes > 0 && r.Ops > 0
}

// Problem describes why OK is false, or returns "".
func (r *LoadReport) Problem() string {
	switch {
	case r.Errors > 0:
		return fmt.Sprintf("%d I/O errors, first: %s", r.Errors, r.FirstError)
	case r.Mismatches > 0:
		return fmt.Sprintf("%d mismatching blocks, first at offset %d", r.Mismatches, *r.FirstMismatch)
	case r.Bytes <= 0 || r.Ops <= 0:
		return "no data moved"
	}
	return ""
}

// ValidRW reports whether rw is one of the access patterns of RunLoad.
func ValidRW(rw string) bool {
	switch rw {
	case "read", "write", "randread", "randwrite":
		return true
	}
	return false
}

func isWrite(rw string) bool { return strings.HasSuffix(rw, "write") }
func isRand(rw string) bool  { return strings.HasPrefix(rw, "rand") }

// ParseSize parses a byte count: a plain number or one with a binary
// suffix k, M, G, T (optionally followed by "i", "iB" or "B"), e.g. 4k,
// 1M, 2GiB. It returns an error for negative or overflowing values.
func ParseSize(s string) (int64, error) {
	t := strings.TrimSpace(s)
	if t == "" {
		return 0, fmt.Errorf("empty size")
	}
	t = strings.TrimSuffix(strings.TrimSuffix(t, "B"), "i")
	mult := int64(1)
	if n := len(t); n > 0 {
		switch t[n-1] {
		case 'k', 'K':
			mult = 1 << 10
		case 'm', 'M':
			mult = 1 << 20
		case 'g', 'G':
			mult = 1 << 30
		case 't', 'T':
			mult = 1 << 40
		}
		if mult > 1 {
			t = t[:n-1]
		}
	}
	v, err := strconv.ParseInt(t, 10, 64)
	if err != nil || v < 0 {
		return 0, fmt.Errorf("invalid size %q", s)
	}
	if v > (1<<63-1)/mult {
		return 0, fmt.Errorf("size %q overflows", s)
	}
	return v * mult, nil
}

// validate checks cfg and fills defaults.
func (cfg *LoadConfig) validate() error {
	if cfg.Addr == "" {
		return errors.New("no server address")
	}
	if !ValidRW(cfg.RW) {
		return fmt.Errorf("invalid rw %q (read, write, randread or randwrite)", cfg.RW)
	}
	if cfg.BlockSize < 512 || cfg.BlockSize%512 != 0 || cfg.BlockSize > nbd.MaxRequestSize {
		return fmt.Errorf("block size %d: want a multiple of 512 up to %d", cfg.BlockSize, nbd.MaxRequestSize)
	}
	if cfg.QueueDepth < 1 || cfg.QueueDepth > 4096 {
		return fmt.Errorf("queue depth %d: want 1..4096", cfg.QueueDepth)
	}
	if cfg.Conns == 0 {
		cfg.Conns = 1
	}
	if cfg.Conns < 0 || cfg.Conns > 64 {
		return fmt.Errorf("connections %d: want 1..64", cfg.Conns)
	}
	if !cfg.Verify && cfg.Duration <= 0 {
		return errors.New("duration must be positive")
	}
	if cfg.Warmup < 0 || cfg.Span < 0 {
		return errors.New("negative warm-up or span")
	}
	if cfg.Seed == 0 {
		cfg.Seed = rand.Uint64() | 1
	}
	return nil
}

// RunLoad connects to the server and runs the workload described by cfg.
// A report is returned whenever the connection succeeded, also when
// requests failed (then err is nil and the report's Errors is set).
func RunLoad(ctx context.Context, cfg LoadConfig) (*LoadReport, error) {
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	t0 := time.Now()
	cl, err := nbd.Dial(ctx, nbd.DialOptions{Addr: cfg.Addr, Export: cfg.Export, Conns: cfg.Conns, MPTCP: cfg.MPTCP, TLS: cfg.TLS})
	if err != nil {
		return nil, fmt.Errorf("connecting to %s: %w", cfg.Addr, err)
	}
	defer cl.Close()
	rep := &LoadReport{
		Addr: cfg.Addr, Export: cfg.Export, RW: cfg.RW, BlockSize: cfg.BlockSize, QueueDepth: cfg.QueueDepth,
		ExportSize: cl.Size(), MPTCP: cl.MultipathTCP(), Verify: cfg.Verify,
		ConnectSeconds: time.Since(t0).Seconds(),
	}
	span := cfg.Span
	if span == 0 || span > cl.Size() {
		span = cl.Size()
	}
	span -= span % int64(cfg.BlockSize)
	if span < int64(cfg.BlockSize) {
		return nil, fmt.Errorf("export of %d bytes is smaller than one block of %d", cl.Size(), cfg.BlockSize)
	}
	rep.Span = span

	sampler := newSubflowSampler(cl)
	if cfg.Verify {
		runVerify(ctx, cl, cfg, span, rep)
	} else {
		runTimed(ctx, cl, cfg, span, rep, sampler)
	}
	if rep.Subflows == nil {
		rep.Subflows = sampler.sample()
	}
	rep.SubflowsMax = sampler.max()
	user, sys := processCPU()
	rep.UserSeconds, rep.SysSeconds = user, sys
	rep.CPUSeconds = user + sys
	return rep, nil
}

// errorLog counts failed requests and remembers the first one.
type errorLog struct {
	n     atomic.Int64
	once  sync.Once
	first string
}

func (e *errorLog) add(err error) {
	e.n.Add(1)
	e.once.Do(func() { e.first = err.Error() })
}

// runTimed runs cfg.QueueDepth workers for Warmup+Duration and fills the
// throughput fields of rep with what completed during the measured window.
func runTimed(ctx context.Context, cl *nbd.Client, cfg LoadConfig, span int64, rep *LoadReport, sampler *subflowSampler) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var (
		bytes, ops atomic.Int64
		cursor     atomic.Int64 // next sequential block number
		errs       errorLog
		wg         sync.WaitGroup
	)
	blocks := span / int64(cfg.BlockSize)
	bs := cfg.BlockSize
	write := isWrite(cfg.RW)
	for w := range cfg.QueueDepth {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(cfg.Seed, uint64(w)))
			buf := make([]byte, bs)
			if write {
				fillRandom(buf, rng)
			}
			for ctx.Err() == nil {
				var blk int64
				if isRand(cfg.RW) {
					blk = rng.Int64N(blocks)
				} else {
					blk = (cursor.Add(1) - 1) % blocks
				}
				off := blk * int64(bs)
				var err error
				if write {
					_, err = cl.WriteAt(buf, off)
				} else {
					_, err = cl.ReadAt(buf, off)
				}
				if err != nil {
					if ctx.Err() == nil {
						errs.add(fmt.Errorf("%s at %d: %w", cfg.RW, off, err))
					}
					cancel()
					return
				}
				bytes.Add(int64(bs))
				ops.Add(1)
			}
		}()
	}

	sampleTick := time.NewTicker(500 * time.Millisecond)
	defer sampleTick.Stop()
	wait := func(d time.Duration) {
		end := time.NewTimer(d)
		defer end.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-end.C:
				return
			case <-sampleTick.C:
				sampler.sample()
			}
		}
	}
	switch {
	case !cfg.MeasureFrom.IsZero():
		late := time.Until(cfg.MeasureFrom)
		if late < 0 {
			errs.add(fmt.Errorf("the load started %v after the measured window began", -late.Round(time.Millisecond)))
			cancel()
		}
		wait(late)
	case cfg.Warmup > 0:
		wait(cfg.Warmup)
	}
	b0, o0, t0 := bytes.Load(), ops.Load(), time.Now()
	rep.WindowStart = t0
	u0, s0 := processCPU()
	wait(cfg.Duration)
	b1, o1, t1 := bytes.Load(), ops.Load(), time.Now()
	u1, s1 := processCPU()
	rep.Subflows = sampler.sample()
	cancel()
	wg.Wait()

	rep.Bytes, rep.Ops = b1-b0, o1-o0
	rep.Seconds = t1.Sub(t0).Seconds()
	if rep.Seconds > 0 {
		rep.MBps = float64(rep.Bytes) / rep.Seconds / 1e6
		rep.IOPS = float64(rep.Ops) / rep.Seconds
	}
	rep.WindowCPUSeconds = (u1 - u0) + (s1 - s0)
	rep.Errors, rep.FirstError = errs.n.Load(), errs.first
}

// runVerify writes a pattern derived from (seed, offset) over the span,
// reads it back and counts the blocks that differ.
func runVerify(ctx context.Context, cl *nbd.Client, cfg LoadConfig, span int64, rep *LoadReport) {
	bs := int64(cfg.BlockSize)
	blocks := span / bs
	var (
		errs       errorLog
		bytes, ops atomic.Int64
		mismatches atomic.Int64
		firstMu    sync.Mutex
	)
	// The block order is shuffled for the random patterns, so the server
	// sees out-of-order offsets, and sequential otherwise.
	order := func(i int64) int64 { return i }
	if isRand(cfg.RW) {
		perm := rand.New(rand.NewPCG(cfg.Seed, 0x5eed)).Perm(int(min(blocks, 1<<24)))
		order = func(i int64) int64 {
			if i < int64(len(perm)) {
				return int64(perm[i])
			}
			return i
		}
	}
	pass := func(write bool) {
		var (
			next atomic.Int64
			wg   sync.WaitGroup
		)
		for range cfg.QueueDepth {
			wg.Add(1)
			go func() {
				defer wg.Done()
				buf := make([]byte, bs)
				want := make([]byte, bs)
				for ctx.Err() == nil {
					i := next.Add(1) - 1
					if i >= blocks {
						return
					}
					off := order(i) * bs
					var err error
					if write {
						FillPattern(buf, cfg.Seed, off)
						_, err = cl.WriteAt(buf, off)
					} else {
						_, err = cl.ReadAt(buf, off)
					}
					if err != nil {
						op := "read"
						if write {
							op = "write"
						}
						errs.add(fmt.Errorf("verify %s at %d: %w", op, off, err))
						return
					}
					bytes.Add(bs)
					ops.Add(1)
					if !write {
						FillPattern(want, cfg.Seed, off)
						if string(buf) != string(want) {
							mismatches.Add(1)
							firstMu.Lock()
							if rep.FirstMismatch == nil || off < *rep.FirstMismatch {
								o := off
								rep.FirstMismatch = &o
							}
							firstMu.Unlock()
						}
					}
				}
			}()
		}
		wg.Wait()
	}
	t0 := time.Now()
	u0, s0 := processCPU()
	pass(true)
	if errs.n.Load() == 0 {
		if err := cl.Flush(); err != nil {
			errs.add(fmt.Errorf("flush: %w", err))
		}
	}
	if errs.n.Load() == 0 {
		pass(false)
	}
	u1, s1 := processCPU()
	rep.Seconds = time.Since(t0).Seconds()
	rep.Bytes, rep.Ops = bytes.Load(), ops.Load()
	if rep.Seconds > 0 {
		rep.MBps = float64(rep.Bytes) / rep.Seconds / 1e6
		rep.IOPS = float64(rep.Ops) / rep.Seconds
	}
	rep.WindowCPUSeconds = (u1 - u0) + (s1 - s0)
	rep.Mismatches = mismatches.Load()
	if errs.n.Load() == 0 {
		rep.VerifiedBytes = (blocks - rep.Mismatches) * bs
	}
	rep.Errors, rep.FirstError = errs.n.Load(), errs.first
}

// FillPattern fills p with the verification pattern of the bytes at
// absolute offset off: every 8-byte word is a hash of seed and the word's
// offset, so any block size and alignment see the same data. off must be
// a multiple of 8.
func FillPattern(p []byte, seed uint64, off int64) {
	var w [8]byte
	for i := 0; i < len(p); i += 8 {
		binary.LittleEndian.PutUint64(w[:], splitmix(seed^uint64(off+int64(i))))
		copy(p[i:], w[:])
	}
}

// splitmix is the SplitMix64 finalizer.
func splitmix(x uint64) uint64 {
	x += 0x9e3779b97f4a7c15
	x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9
	x = (x ^ (x >> 27)) * 0x94d049bb133111eb
	return x ^ (x >> 31)
}

func fillRandom(p []byte, rng *rand.Rand) {
	for i := 0; i+8 <= len(p); i += 8 {
		binary.LittleEndian.PutUint64(p[i:], rng.Uint64())
	}
}

// subflowSampler reads MPTCP_INFO of every connection of a client and
// keeps the largest subflow count seen per connection.
type subflowSampler struct {
	cl   *nbd.Client
	mu   sync.Mutex
	maxs []int
}

func newSubflowSampler(cl *nbd.Client) *subflowSampler {
	return &subflowSampler{cl: cl, maxs: make([]int, len(cl.Conns()))}
}

// sample returns the current subflow count of every connection (0 for
// plain TCP) and updates the maxima.
func (s *subflowSampler) sample() []int {
	conns := s.cl.Conns()
	out := make([]int, len(conns))
	for i, c := range conns {
		if info, err := mptcp.GetInfo(c); err == nil {
			out[i] = info.TotalSubflows()
		}
	}
	s.mu.Lock()
	for i, v := range out {
		s.maxs[i] = max(s.maxs[i], v)
	}
	s.mu.Unlock()
	return out
}

func (s *subflowSampler) max() []int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]int(nil), s.maxs...)
}
