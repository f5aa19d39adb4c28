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
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"os"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/mpnbd/mpnbd/internal/testenv/powerloss"
	"github.com/mpnbd/mpnbd/pkg/nbd"
)

// clientBackend is a replica reached over NBD used as the primary's own
// copy: the power-loss node stands for the primary's disk.
type clientBackend struct{ *nbd.Client }

func (b clientBackend) Sync() error                          { return b.Flush() }
func (b clientBackend) Zero(off, n int64, noHole bool) error { return b.WriteZeroes(off, n, noHole) }
func (b clientBackend) Resize(int64) error                   { return errors.New("no resize") }

func dialPowerLoss(t *testing.T, n *powerloss.Node) *nbd.Client {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	cl, err := nbd.Dial(ctx, nbd.DialOptions{Addr: n.Addr, Export: powerloss.Export, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	return cl
}

// crashBlocks is the size of the crash tests' volume, in 4 KiB blocks.
const crashBlocks = 128

// TestMirrorCrashConsistency: the primary and two replicas are storage
// nodes whose writes sit in a cache until a FLUSH and that lose it with
// their power. Writers (each owning its blocks, each write stamped with a
// sequence number) write, trim and FLUSH through the Mirror while faults
// strike at random points: a replica loses power (its connections reset),
// a replica's sync fails as a writeback error does (its cache lost), a
// replica loses power, comes back and is rebuilt, the arbiter is slow to
// record a drop, or cannot be reached at all. Then the primary loses power, and
// with it, at random, the replicas too. Every replica the arbiter still
// lists in sync, any of which may become primary, must hold in its
// durable medium every write acknowledged before a FLUSH that completed
// began (or a later write of the block), and nothing never written.
// RELAY_CRASH_POINTS (also read by the relay's crash test) sets how many
// crash points run (40 by default; make soak runs more).
func TestMirrorCrashConsistency(t *testing.T) {
	points := 40
	if v := os.Getenv("RELAY_CRASH_POINTS"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n <= 0 {
			t.Fatalf("RELAY_CRASH_POINTS=%q: want a positive number", v)
		}
		points = max(n/5, 1)
	}
	for i := range points {
		seed := uint64(time.Now().UnixNano()) + uint64(i)
		t.Run(fmt.Sprint(i), func(t *testing.T) {
			t.Parallel()
			crashPoint(t, rand.New(rand.NewPCG(seed, uint64(i))), seed)
		})
	}
}

func crashPoint(t *testing.T, rng *rand.Rand, seed uint64) {
	const size = crashBlocks * 4096
	primary := powerloss.Start(t, size)
	nodes := map[string]*powerloss.Node{"b": powerloss.Start(t, size), "c": powerloss.Start(t, size)}
	arb := &fakeArbiter{epoch: 1}
	// The arbiter answers at once, slowly, or not before the crash (the
	// primary cut off from the API server).
	switch rng.IntN(3) {
	case 1:
		arb.gate = make(chan error)
		arng := rand.New(rand.NewPCG(seed, 99))
		go func() {
			for {
				time.Sleep(time.Duration(arng.IntN(30)) * time.Millisecond)
				select {
				case arb.gate <- nil:
				case <-t.Context().Done():
					return
				}
			}
		}()
	case 2:
		arb.gate = make(chan error)
	}
	peers := map[string]Peer{}
	for name, n := range nodes {
		peers[name] = dialPowerLoss(t, n)
	}
	m, err := New(Config{Local: clientBackend{dialPowerLoss(t, primary)}, Peers: peers, Epoch: 1, Arbiter: arb,
		Deadline: 2 * time.Second, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Close() })

	// The model: hist[b] is what block b was given, in order (index 0:
	// the zeroes it starts with; a trim gives zeroes again); acked[b] the
	// index of its last acknowledged change; floor[b] the index every
	// crash must keep (a completed FLUSH began after it was
	// acknowledged): the block must hold hist[b][j] for some j >= floor[b].
	var (
		mu      sync.Mutex
		hist    = make([][]uint64, crashBlocks)
		acked   = make([]int, crashBlocks)
		floor   = make([]int, crashBlocks)
		crashed bool
	)
	for b := range hist {
		hist[b] = []uint64{0}
	}
	// change records that blk is given v and runs do; an acknowledgement
	// before the crash moves acked.
	change := func(blk int, v uint64, do func() error) {
		mu.Lock()
		hist[blk] = append(hist[blk], v)
		idx := len(hist[blk]) - 1
		mu.Unlock()
		if do() == nil {
			mu.Lock()
			if !crashed {
				acked[blk] = idx
			}
			mu.Unlock()
		}
	}
	ctx, stop := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	const writers = 4
	for g := range writers {
		wg.Add(1)
		wrng := rand.New(rand.NewPCG(seed, uint64(g)))
		go func() {
			defer wg.Done()
			rng := wrng
			seq := uint64(g+1) << 40
			buf := make([]byte, 4096)
			for ctx.Err() == nil {
				blk := rng.IntN(crashBlocks/writers)*writers + g
				seq++
				switch rng.IntN(10) {
				case 0:
					// A FLUSH: what was acknowledged when it began is
					// kept once it completes.
					mu.Lock()
					covered := slices.Clone(acked)
					mu.Unlock()
					if m.Sync() != nil {
						continue
					}
					mu.Lock()
					if !crashed {
						for b, s := range covered {
							floor[b] = max(floor[b], s)
						}
					}
					mu.Unlock()
					continue
				case 1:
					change(blk, 0, func() error { return m.Trim(int64(blk)*4096, 4096) })
					continue
				}
				for i := 0; i < len(buf); i += 8 {
					binary.LittleEndian.PutUint64(buf[i:], seq)
				}
				change(blk, seq, func() error {
					_, err := m.WriteAt(buf, int64(blk)*4096)
					return err
				})
			}
		}()
	}

	// Faults before the crash, each at a random point.
	time.Sleep(time.Duration(20+rng.IntN(80)) * time.Millisecond)
	var faults []string
	var rebuilt sync.WaitGroup
	defer rebuilt.Wait()
	switch rng.IntN(5) {
	case 3:
		// b loses power, comes back (a new incarnation, holding what it
		// flushed) and is rebuilt while the writers go on; the crash
		// finds the rebuild done or under way.
		nodes["b"].PowerLoss()
		faults = append(faults, "b lost power")
		for deadline := time.Now().Add(2 * time.Second); m.Lacking("b") == nil; time.Sleep(5 * time.Millisecond) {
			if time.Now().After(deadline) {
				break
			}
		}
		if m.Lacking("b") == nil {
			break // the arbiter is unreachable: b is never out
		}
		nodes["b"].Restore()
		cl := dialPowerLoss(t, nodes["b"])
		faults = append(faults, "b came back and is rebuilt")
		rebuilt.Add(1)
		go func() {
			defer rebuilt.Done()
			_ = m.Rebuild(t.Context(), "b", cl, RebuildOptions{})
		}()
	case 0:
		nodes["b"].PowerLoss()
		faults = append(faults, "b lost power")
	case 1:
		nodes["c"].FailNextSync()
		faults = append(faults, "c's next sync fails")
	case 2:
		nodes["b"].PowerLoss()
		nodes["c"].FailNextSync()
		faults = append(faults, "b lost power", "c's next sync fails")
	}
	time.Sleep(time.Duration(20+rng.IntN(80)) * time.Millisecond)

	// The crash: the primary loses power, the replicas too at random.
	// Acknowledgements from here on count for nothing.
	mu.Lock()
	crashed = true
	mu.Unlock()
	inSync := arb.inSync([]string{"b", "c"})
	arb.mu.Lock()
	if len(arb.rejoins) > 0 {
		faults = append(faults, "b was back in sync")
	}
	arb.mu.Unlock()
	primary.PowerLoss()
	faults = append(faults, "the primary lost power")
	for _, name := range []string{"b", "c"} {
		if rng.IntN(2) == 0 {
			nodes[name].PowerLoss()
			faults = append(faults, name+" lost power with it")
		}
	}
	stop()
	m.Close()
	wg.Wait()
	rebuilt.Wait()

	if os.Getenv("REPLICA_CRASH_VERBOSE") != "" {
		t.Logf("faults: %v; checked %v", faults, inSync)
	}
	if len(inSync) == 0 {
		// Both replicas left: the primary alone held the data, and it
		// lost power. Nothing to check but that the drops were recorded.
		return
	}
	for _, name := range inSync {
		durable := nodes[name].Durable(0, size)
		for b := range crashBlocks {
			s := binary.LittleEndian.Uint64(durable[b*4096:])
			for i := 8; i < 4096; i += 8 {
				if binary.LittleEndian.Uint64(durable[b*4096+i:]) != s {
					t.Fatalf("seed %d (%v): replica %s, block %d is torn", seed, faults, name, b)
				}
			}
			mu.Lock()
			h, fl := hist[b], floor[b]
			mu.Unlock()
			switch {
			case !slices.Contains(h, s):
				t.Fatalf("seed %d (%v): replica %s, block %d holds %#x, which was never written", seed, faults, name, b, s)
			case !slices.Contains(h[fl:], s):
				t.Fatalf("seed %d (%v): replica %s, in sync when the primary lost power, lost block %d's %#x, which a completed FLUSH covered (it holds %#x, an older one)",
					seed, faults, name, b, h[fl], s)
			}
		}
	}
}

// inSync lists the names still in the in-sync set by the arbiter's
// record: those of all that it has not dropped.
func (a *fakeArbiter) inSync(all []string) []string {
	dropped := a.dropped()
	return slices.DeleteFunc(slices.Clone(all), func(n string) bool { return slices.Contains(dropped, n) })
}
