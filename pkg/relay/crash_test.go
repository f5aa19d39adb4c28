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
	"bytes"
	"context"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	mrand "math/rand/v2"
	"net"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"

	"github.com/mpnbd/mpnbd/pkg/nbd"
)

// powerLossBackend is a disk with a volatile write cache: writes land in
// the cache, Sync copies the blocks written since the last one to the
// durable medium, and crash throws the cache away, as a power loss of
// the storage host does.
type powerLossBackend struct {
	mu      sync.Mutex
	durable []byte
	cache   []byte
	dirty   map[int64]struct{} // blocks written since the last Sync
	dead    bool               // powered off: everything is dropped
}

const plBlock = 4096

func newPowerLossBackend(size int64) *powerLossBackend {
	return &powerLossBackend{durable: make([]byte, size), cache: make([]byte, size), dirty: map[int64]struct{}{}}
}

func (b *powerLossBackend) ReadAt(p []byte, off int64) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return copy(p, b.cache[off:]), nil
}

func (b *powerLossBackend) WriteAt(p []byte, off int64) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.dead {
		return len(p), nil
	}
	for blk := off / plBlock; blk*plBlock < off+int64(len(p)); blk++ {
		b.dirty[blk] = struct{}{}
	}
	return copy(b.cache[off:], p), nil
}

func (b *powerLossBackend) Size() int64 { return int64(len(b.cache)) }

func (b *powerLossBackend) Sync() error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.dead {
		return nil
	}
	for blk := range b.dirty {
		o := blk * plBlock
		copy(b.durable[o:o+plBlock], b.cache[o:o+plBlock])
	}
	clear(b.dirty)
	return nil
}

func (b *powerLossBackend) Trim(off, n int64) error { return b.Zero(off, n, false) }
func (b *powerLossBackend) Zero(off, n int64, _ bool) error {
	_, err := b.WriteAt(make([]byte, n), off)
	return err
}
func (b *powerLossBackend) Resize(int64) error { return fmt.Errorf("not supported") }
func (b *powerLossBackend) Close() error       { return nil }

// crash loses the cache and returns how many blocks were lost; nothing
// reaches the medium until revive.
func (b *powerLossBackend) crash() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.dead = true
	lost := 0
	for blk := range b.dirty {
		o := blk * plBlock
		if !bytes.Equal(b.cache[o:o+plBlock], b.durable[o:o+plBlock]) {
			lost++
		}
	}
	copy(b.cache, b.durable)
	clear(b.dirty)
	return lost
}

func (b *powerLossBackend) revive() {
	b.mu.Lock()
	b.dead = false
	b.mu.Unlock()
}

// powerLoss cuts the server off the network (no reply leaves any more),
// drops the storage host's cache, stops the server and boots it again as a
// new incarnation. It returns the blocks lost from the cache.
func powerLoss(ts *testServer, be *powerLossBackend) int {
	ts.cut()
	lost := be.crash()
	ts.kill()
	be.revive()
	ts.inc = newIncarnation()
	ts.start()
	return lost
}

func (b *powerLossBackend) durableAt(blk int64) []byte {
	b.mu.Lock()
	defer b.mu.Unlock()
	return bytes.Clone(b.durable[blk*plBlock : (blk+1)*plBlock])
}

// powerLossSession starts a server of be with an incarnation of its own
// and dials it in a new session: the server, the session's dialer, the
// first connection and what its handshake said.
func powerLossSession(t *testing.T, be nbd.Backend) (*testServer, Dialer, net.Conn, nbd.ExportInfo) {
	t.Helper()
	ts := &testServer{t: t, backend: be, inc: newIncarnation()}
	ts.start()
	t.Cleanup(ts.kill)
	dial := sessionDialer(ts.addr, nbd.NewSessionID())
	remote, err := dial(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	info := remote.(*Remote).Info
	if !info.Fenced {
		t.Fatal("the test server did not take the session")
	}
	return ts, dial, remote, info
}

// sessionDialer dials addr and announces session id, returning a Remote
// so that the relay learns the server's incarnation.
func sessionDialer(addr string, id nbd.SessionID) Dialer {
	return func(ctx context.Context) (net.Conn, error) {
		var d net.Dialer
		c, err := d.DialContext(ctx, "tcp", addr)
		if err != nil {
			return nil, err
		}
		info, err := nbd.NegotiateConnWith(ctx, c, exportName, nbd.NegotiateOptions{Session: &nbd.Session{ID: id, Generation: nbd.NextGeneration()}})
		if err != nil {
			c.Close()
			return nil, err
		}
		return &Remote{Conn: c, Info: info}, nil
	}
}

// blockData is the content of block blk written with sequence number seq.
func blockData(blk int64, seq uint64) []byte {
	b := make([]byte, plBlock)
	binary.BigEndian.PutUint64(b, uint64(blk))
	binary.BigEndian.PutUint64(b[8:], seq)
	for i := 16; i < len(b); i += 8 {
		binary.BigEndian.PutUint64(b[i:], seq*0x9e3779b97f4a7c15+uint64(i))
	}
	return b
}

func newIncarnation() nbd.Incarnation {
	var inc nbd.Incarnation
	rand.Read(inc[:])
	return inc
}

// TestCrashConsistency drives sequence-numbered writes (plain and FUA),
// trims, write-zeroes and flushes through
// the relay while the storage server loses power (its write cache) and
// comes back as a new incarnation, again and again. Every write the
// kernel side saw acknowledged must read back afterwards, the last one of
// each block winning; after a final FLUSH it must be on the durable
// medium. RELAY_CRASH_POINTS sets the number of crashes (200 by default).
func TestCrashConsistency(t *testing.T) {
	t.Run("kernel socket", func(t *testing.T) { crashConsistency(t, viaSocket) })
	t.Run("in-process calls", func(t *testing.T) { crashConsistency(t, viaCalls) })
	t.Run("in-process owned writes", func(t *testing.T) { crashConsistency(t, viaOwned) })
	t.Run("in-process started requests", func(t *testing.T) { crashConsistency(t, viaStart) })
}

// How the workload reaches the relay.
const (
	viaSocket = iota // a client on the kernel's end of the socket pair
	viaCalls         // in-process calls (RoundTrip)
	viaOwned         // in-process calls, writes handing their buffer over
	viaStart         // Start and Push, reads and writes, every other write owned
)

// ownedWrites is a block client whose writes hand their buffer to the
// relay (WriteOwned): a buffer recycled while the relay still needs it
// shows as another write's data.
type ownedWrites struct {
	*nbd.Client
	r *Relay
}

// startedRequests is a block client on Start and Push.
type startedRequests struct {
	*nbd.Client
	r      *Relay
	writes atomic.Int64
}

func (s *startedRequests) do(req nbd.Request, payload []byte, owned *[]byte, dst []byte) error {
	done := make(chan error, 1)
	s.r.Start(req, payload, owned, dst, func(err error) { done <- err })
	s.r.Push()
	return <-done
}

func (s *startedRequests) ReadAt(p []byte, off int64) (int, error) {
	if err := s.do(nbd.Request{Type: nbd.CmdRead, Offset: uint64(off), Length: uint32(len(p))}, nil, nil, p); err != nil {
		return 0, err
	}
	return len(p), nil
}

func (s *startedRequests) WriteAt(p []byte, off int64) (int, error) {
	req := nbd.Request{Type: nbd.CmdWrite, Offset: uint64(off), Length: uint32(len(p))}
	var owned *[]byte
	if s.writes.Add(1)%2 == 0 {
		owned = Buffer(len(p))
		copy(*owned, p)
	}
	if err := s.do(req, p, owned, nil); err != nil {
		return 0, err
	}
	return len(p), nil
}

func (s *startedRequests) Flush() error { return s.do(nbd.Request{Type: nbd.CmdFlush}, nil, nil, nil) }

func (o ownedWrites) WriteAt(p []byte, off int64) (int, error) {
	buf := Buffer(len(p))
	copy(*buf, p)
	if err := o.r.WriteOwned(nbd.Request{Type: nbd.CmdWrite, Offset: uint64(off), Length: uint32(len(p))}, buf); err != nil {
		return 0, err
	}
	return len(p), nil
}

// blockClient is what the workload needs of the local side.
type blockClient interface {
	ReadAt(p []byte, off int64) (int, error)
	WriteAt(p []byte, off int64) (int, error)
	WriteAtFlags(p []byte, off int64, flags uint16) (int, error)
	TrimFlags(off, length int64, flags uint16) error
	WriteZeroesFlags(off, length int64, flags uint16) error
	Flush() error
}

func crashConsistency(t *testing.T, via int) {
	points := 200
	if v := os.Getenv("RELAY_CRASH_POINTS"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil {
			t.Fatalf("RELAY_CRASH_POINTS=%q: %v", v, err)
		}
		points = n
	}
	const (
		blocks  = 256
		writers = 4
	)
	be := newPowerLossBackend(blocks * plBlock)
	ts, dial, remote, info := powerLossSession(t, be)
	// A small retention budget makes the relay flush by itself too.
	o := Options{ReconnectBackoff: time.Millisecond, MaxBackoff: 20 * time.Millisecond, RetainBytes: 512 << 10, MaxInflightBytes: 4 << 20, Logger: quietLogger()}
	var client blockClient
	var relay *Relay
	if via != viaSocket {
		relay = startLocal(t, remote, dial, o)
		client = nbd.NewClientOn(info, relay, quietLogger())
		switch via {
		case viaOwned:
			client = ownedWrites{client.(*nbd.Client), relay}
		case viaStart:
			client = &startedRequests{Client: client.(*nbd.Client), r: relay}
		}
	} else {
		rg := newRig(t, remote, dial, &info, o)
		client, relay = rg.client, rg.relay
	}

	var stop atomic.Bool
	var wg sync.WaitGroup
	last := make([]uint64, blocks) // per block, the last sequence number acknowledged
	var seq atomic.Uint64
	errs := make(chan error, writers)
	var writes, flushes atomic.Int64
	for w := 0; w < writers; w++ {
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			rnd := mrand.New(mrand.NewPCG(uint64(w), 7))
			for i := 0; !stop.Load(); i++ {
				blk := int64(rnd.IntN(blocks/writers)*writers + w)
				s := seq.Add(1)
				// Mostly plain writes; FUA writes, trims and write-zeroes
				// (with and without FUA) among them, each of which a
				// replay of older retained writes must not undo.
				var err error
				op := rnd.IntN(10)
				fua := uint16(0)
				if rnd.IntN(2) == 0 {
					fua = nbd.CmdFlagFUA
				}
				switch op {
				case 0:
					_, err = client.WriteAtFlags(blockData(blk, s), blk*plBlock, nbd.CmdFlagFUA)
				case 1:
					err = client.TrimFlags(blk*plBlock, plBlock, fua)
				case 2:
					err = client.WriteZeroesFlags(blk*plBlock, plBlock, fua)
				default:
					_, err = client.WriteAt(blockData(blk, s), blk*plBlock)
				}
				if err != nil {
					errs <- fmt.Errorf("request %d (op %d) to block %d: %w", s, op, blk, err)
					return
				}
				if op == 1 || op == 2 {
					last[blk] = 0 // reads as zeroes
				} else {
					last[blk] = s
				}
				writes.Add(1)
				if i%48 == 47 {
					if err := client.Flush(); err != nil {
						errs <- fmt.Errorf("flush: %w", err)
						return
					}
					flushes.Add(1)
				}
			}
		}(w)
	}

	lostTotal, lossyPoints := 0, 0
	rnd := mrand.New(mrand.NewPCG(99, 1))
	for i := 0; i < points; i++ {
		time.Sleep(time.Duration(1+rnd.IntN(8)) * time.Millisecond)
		before := relay.Stats().Reconnects
		if n := powerLoss(ts, be); n > 0 {
			lostTotal += n
			lossyPoints++
		}
		// The next crash point meets a live session, with traffic.
		waitFor(t, 10*time.Second, "the relay to reconnect", func() bool { return relay.Stats().Reconnects > before })
		select {
		case err := <-errs:
			t.Fatal(err)
		default:
		}
	}
	stop.Store(true)
	waitDone(t, &wg, 60*time.Second, "writers")
	select {
	case err := <-errs:
		t.Fatal(err)
	default:
	}

	check := func(when string, read func(blk int64) []byte) {
		t.Helper()
		bad := 0
		for blk := int64(0); blk < blocks; blk++ {
			want := make([]byte, plBlock)
			if last[blk] != 0 {
				want = blockData(blk, last[blk])
			}
			if got := read(blk); !bytes.Equal(got, want) {
				if bad < 5 {
					t.Errorf("%s: block %d holds sequence %d, want %d", when, blk, binary.BigEndian.Uint64(got[8:]), last[blk])
				}
				bad++
			}
		}
		if bad > 0 {
			t.Fatalf("%s: %d of %d blocks lost an acknowledged write", when, bad, blocks)
		}
	}
	viaClient := func(blk int64) []byte {
		b := make([]byte, plBlock)
		if _, err := client.ReadAt(b, blk*plBlock); err != nil {
			t.Fatalf("read block %d: %v", blk, err)
		}
		return b
	}
	// One more power loss with nothing flushed since the last writes: the
	// relay must send them again.
	powerLoss(ts, be)
	check("after a power loss with unflushed writes", viaClient)
	if err := client.Flush(); err != nil {
		t.Fatal(err)
	}
	ts.cut()
	be.crash()
	ts.kill()
	check("on the durable medium after a final flush", be.durableAt)

	st := relay.Stats()
	t.Logf("%d crash points (%d lost cached blocks, %d blocks in all), %d writes, %d flushes; relay: %d reconnects, %d writes sent again, %d flushes of its own",
		points, lossyPoints, lostTotal, writes.Load(), flushes.Load(), st.Reconnects, st.RetainedReplays, st.OwnFlushes)
	if points >= 50 && lossyPoints < points/20 {
		t.Fatalf("only %d of %d crash points lost cached writes: the test does not exercise power loss", lossyPoints, points)
	}
	if st.RetainedReplays == 0 {
		t.Fatal("no acknowledged write was ever sent again")
	}
}

func waitDone(t *testing.T, wg *sync.WaitGroup, d time.Duration, what string) {
	t.Helper()
	ch := make(chan struct{})
	go func() { wg.Wait(); close(ch) }()
	select {
	case <-ch:
	case <-time.After(d):
		t.Fatalf("%s did not finish within %v", what, d)
	}
}

// TestRetainedResendPolicy: after a reconnect to the same incarnation of a
// fencing server nothing acknowledged is sent again; to a new incarnation,
// or to a server that cannot tell (no session), every retained write is.
func TestRetainedResendPolicy(t *testing.T) {
	for _, tc := range []struct {
		name          string
		session       bool
		newIncarnaton bool
		resent        bool
	}{
		{"same incarnation", true, false, false},
		{"new incarnation", true, true, true},
		{"server without sessions", false, false, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ts := &testServer{t: t, backend: nbd.NewMemBackend(1 << 20), inc: newIncarnation()}
			ts.start()
			t.Cleanup(ts.kill)
			dial := negotiatingDialer(ts.addr, false)
			if tc.session {
				dial = sessionDialer(ts.addr, nbd.NewSessionID())
			}
			remote, err := dial(context.Background())
			if err != nil {
				t.Fatal(err)
			}
			info := nbd.ExportInfo{Size: 1 << 20, Flags: nbd.FlagHasFlags | nbd.FlagSendFlush}
			rg := newRig(t, remote, dial, &info, Options{ReconnectBackoff: time.Millisecond})
			client, relay := rg.client, rg.relay
			for i := int64(0); i < 8; i++ {
				if _, err := client.WriteAt(blockData(i, 1), i*plBlock); err != nil {
					t.Fatal(err)
				}
			}
			if st := relay.Stats(); st.Retained != 8 {
				t.Fatalf("%d writes retained, want 8", st.Retained)
			}
			ts.kill()
			if tc.newIncarnaton {
				ts.inc = newIncarnation()
			}
			ts.start()
			if _, err := client.WriteAt(blockData(9, 1), 9*plBlock); err != nil {
				t.Fatal(err)
			}
			st := relay.Stats()
			if got := st.RetainedReplays > 0; got != tc.resent {
				t.Fatalf("%d retained writes sent again; want some: %v", st.RetainedReplays, tc.resent)
			}
			if tc.resent && st.RetainedReplays != 8 {
				t.Fatalf("%d retained writes sent again, want 8", st.RetainedReplays)
			}
			if err := client.Flush(); err != nil {
				t.Fatal(err)
			}
			if st := relay.Stats(); st.Retained != 0 || st.RetainedBytes != 0 {
				t.Fatalf("after a completed flush: %d writes (%d bytes) still retained", st.Retained, st.RetainedBytes)
			}
		})
	}
}

// TestOwnFlushBoundsRetention: writes with no FLUSH from the kernel side
// make the relay flush by itself once RetainBytes is reached, so what it
// holds stays bounded; a FUA write is retained only behind others.
func TestOwnFlushBoundsRetention(t *testing.T) {
	ts := newTestServer(t, 8<<20, false)
	const budget = 256 << 10
	const limit = 4 * budget
	rg := newServerRig(t, ts, Options{RetainBytes: budget, MaxInflightBytes: limit})
	client, relay := rg.client, rg.relay
	buf := make([]byte, 64<<10)
	for i := int64(0); i < 64; i++ {
		if _, err := client.WriteAt(buf, i*int64(len(buf))); err != nil {
			t.Fatal(err)
		}
		// Writes answered while the relay's own flush is in flight are
		// kept too; the in-flight budget bounds them all.
		if st := relay.Stats(); st.RetainedBytes+st.InFlightBytes > limit+bufCap(len(buf))+entryOverhead {
			t.Fatalf("retained %d bytes (+%d in flight) with a limit of %d", st.RetainedBytes, st.InFlightBytes, limit)
		}
	}
	waitFor(t, 5*time.Second, "a flush of the relay's own", func() bool { return relay.Stats().OwnFlushes > 0 })
	// The relay's own flush is answered and goes nowhere.
	waitFor(t, 5*time.Second, "the relay's flush to complete", func() bool { return relay.Stats().InFlight == 0 })
	// With nothing retained, a FUA write is durable and kept by nobody;
	// after a plain write it is kept behind it (TestFUAWriteNotUndoneByReplay).
	if err := client.Flush(); err != nil {
		t.Fatal(err)
	}
	if _, err := client.WriteAtFlags(buf, 0, nbd.CmdFlagFUA); err != nil {
		t.Fatal(err)
	}
	if st := relay.Stats(); st.Retained != 0 {
		t.Fatalf("a FUA write after a completed flush was retained (%d retained)", st.Retained)
	}
	if _, err := client.WriteAt(buf, 0); err != nil {
		t.Fatal(err)
	}
	if _, err := client.WriteAtFlags(buf, 0, nbd.CmdFlagFUA); err != nil {
		t.Fatal(err)
	}
	if st := relay.Stats(); st.Retained != 2 {
		t.Fatalf("a plain write then a FUA write: %d retained, want both", st.Retained)
	}
}

// TestFUAWriteNotUndoneByReplay: a plain write A and then a FUA write B to
// the same block, both acknowledged; the storage host loses power, so
// only B is durable, and A is still retained for replay. The replay after
// the reconnect must not leave A on the block: B was acknowledged later.
func TestFUAWriteNotUndoneByReplay(t *testing.T) {
	for _, cmd := range []string{"write", "trim", "write-zeroes"} {
		t.Run(cmd, func(t *testing.T) {
			be := newPowerLossBackend(64 * plBlock)
			ts, dial, remote, info := powerLossSession(t, be)
			rg := newRig(t, remote, dial, &info, Options{ReconnectBackoff: time.Millisecond})
			client, relay := rg.client, rg.relay
			const blk = 3
			if _, err := client.WriteAt(blockData(blk, 1), blk*plBlock); err != nil {
				t.Fatal(err)
			}
			want := blockData(blk, 2)
			var err error
			switch cmd {
			case "write":
				_, err = client.WriteAtFlags(want, blk*plBlock, nbd.CmdFlagFUA)
			case "trim":
				want = make([]byte, plBlock)
				err = client.TrimFlags(blk*plBlock, plBlock, nbd.CmdFlagFUA)
			case "write-zeroes":
				want = make([]byte, plBlock)
				err = client.WriteZeroesFlags(blk*plBlock, plBlock, nbd.CmdFlagFUA)
			}
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(be.durableAt(blk), want) {
				t.Fatal("the FUA request was acknowledged before it was durable")
			}
			before := relay.Stats().Reconnects
			powerLoss(ts, be)
			// Any request now meets the dead connection and makes the relay
			// reconnect to the new incarnation and replay.
			got := make([]byte, plBlock)
			if _, err := client.ReadAt(got, blk*plBlock); err != nil {
				t.Fatal(err)
			}
			if relay.Stats().Reconnects == before {
				t.Fatal("the relay did not reconnect after the power loss")
			}
			if !bytes.Equal(got, want) {
				t.Fatalf("after the replay the block holds sequence %d: the acknowledged FUA %s was undone",
					binary.BigEndian.Uint64(got[8:]), cmd)
			}
		})
	}
}

// failingSyncBackend reports a writeback error to one sync only, as Linux
// does for an open file.
type failingSyncBackend struct {
	nbd.Backend
	pending atomic.Bool
}

func (b *failingSyncBackend) Sync() error {
	if b.pending.CompareAndSwap(true, false) {
		return fmt.Errorf("writeback failed")
	}
	return b.Backend.Sync()
}

// TestOwnFlushFailureReachesLocalFlush: the relay's own FLUSH fails (the
// storage host could not write back acknowledged writes). The local
// side's next FLUSH must fail, although the server reports the failure
// only once and the relay's retry of its own flush succeeded.
func TestOwnFlushFailureReachesLocalFlush(t *testing.T) {
	for _, via := range []string{"kernel socket", "in-process calls"} {
		t.Run(via, func(t *testing.T) {
			be := &failingSyncBackend{Backend: nbd.NewMemBackend(8 << 20)}
			ts := &testServer{t: t, backend: be}
			ts.start()
			t.Cleanup(ts.kill)
			o := Options{RetainBytes: 128 << 10, MaxInflightBytes: 1 << 20}
			var client blockClient
			var relay *Relay
			if via == "kernel socket" {
				rg := newServerRig(t, ts, o)
				client, relay = rg.client, rg.relay
			} else {
				remote, info, err := dialNegotiated(context.Background(), ts.addr, false)
				if err != nil {
					t.Fatal(err)
				}
				o.Logger = quietLogger()
				relay = startLocal(t, remote, negotiatingDialer(ts.addr, false), o)
				client = nbd.NewClientOn(info, relay, quietLogger())
			}
			be.pending.Store(true)
			buf := make([]byte, 64<<10)
			for i := int64(0); be.pending.Load(); i++ {
				if i == 64 {
					t.Fatal("64 writes past the retention budget and the relay never flushed by itself")
				}
				if _, err := client.WriteAt(buf, (i%16)*int64(len(buf))); err != nil {
					t.Fatal(err)
				}
			}
			waitFor(t, 5*time.Second, "the relay's flushes to complete", func() bool { return relay.Stats().InFlight == 0 })
			if st := relay.Stats(); !st.FlushErrorOwed || st.OwnFlushFailures != 1 {
				t.Fatalf("after the relay's own flush failed: owed %v, %d failures", st.FlushErrorOwed, st.OwnFlushFailures)
			}
			if via == "kernel socket" {
				// A handover now would lose the report.
				ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
				_, err := relay.Pause(ctx)
				cancel()
				if !errors.Is(err, ErrFlushFailureOwed) {
					t.Fatalf("Pause with a failed flush owed to the local side: %v", err)
				}
			}
			if err := client.Flush(); err == nil {
				t.Fatal("FLUSH succeeded after the relay's own flush failed: acknowledged writes may be lost and nobody was told")
			}
			if err := client.Flush(); err != nil {
				t.Fatalf("the failure was reported once; the next FLUSH: %v", err)
			}
			if via == "kernel socket" {
				ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
				_, err := relay.Pause(ctx)
				cancel()
				if err != nil {
					t.Fatalf("Pause once the failure was reported: %v", err)
				}
				relay.Resume()
			}
		})
	}
}

// TestRetentionBudgetCountsWhatIsHeld: trims carry no data, but each one
// retained holds its entry. A run of them must not hold more memory than
// the in-flight budget allows.
func TestRetentionBudgetCountsWhatIsHeld(t *testing.T) {
	ts := newTestServer(t, 64<<20, false)
	const limit = 256 << 10
	rg := newServerRig(t, ts, Options{RetainBytes: limit / 2, MaxInflightBytes: limit})
	client, relay := rg.client, rg.relay
	held := int(unsafe.Sizeof(entry{}))
	peak := 0
	for i := int64(0); i < 6000; i++ {
		if err := client.Trim((i%16000)*4096, 4096); err != nil {
			t.Fatal(err)
		}
		st := relay.Stats()
		peak = max(peak, st.Retained+st.InFlight)
	}
	if peak*held > limit {
		t.Fatalf("%d requests held at once, %d bytes of entries alone, with a budget of %d bytes", peak, peak*held, limit)
	}
	if relay.Stats().OwnFlushes == 0 {
		t.Fatal("the relay never flushed by itself: the test did not reach the budget")
	}
}
