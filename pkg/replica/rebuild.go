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
	"cmp"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/mpnbd/mpnbd/pkg/nbd"
)

// Rebuild by difference (docs/replication.md).
//
// A replica that left the in-sync set comes back through Rebuild: from
// the moment it starts, every change is forwarded to the replica as to
// one in sync (and still marked in its log, ahead of the change's
// acknowledgement, until the arbiter has it back); meanwhile the chunks
// its log held when the rebuild began are copied from the primary's copy,
// each under a claim of its range, so that no change to a chunk lands
// between the copy's read and its write. Then a FLUSH makes all of it durable on the
// replica, and the arbiter records it in sync again; only then is its log
// removed. A failure of the replica on the way leaves it out, its log
// whole (nothing was taken off it), and a later Rebuild starts over.

// ErrRebuildAborted: the replica failed during its rebuild; it stays out.
var ErrRebuildAborted = errors.New("replica: rebuild aborted")

// logPath is where the log of replica name is kept in LogDir.
func (m *Mirror) logPath(name string) string { return filepath.Join(m.logDir, name+".dirty") }

// failed handles a call to p that failed: a replica in sync leaves the set
// (startDrop); one being rebuilt is out again, its log whole.
func (m *Mirror) failed(p *peer, err error) {
	m.mu.Lock()
	if p.state == rebuilding {
		p.state = out
		p.cause = err
		m.mu.Unlock()
		p.client().Close()
		m.log.Warn("the replica being rebuilt failed: it stays out", "replica", p.name, "error", err)
		m.changed(p)
		return
	}
	m.mu.Unlock()
	m.startDrop(p, err)
}

// RebuildOptions tunes Rebuild.
type RebuildOptions struct {
	// Rate bounds the copy, in bytes per second, so that foreground I/O
	// keeps most of the line; zero copies as fast as the replica takes it.
	Rate float64
	// Progress, when set, is told the bytes copied and to copy after each
	// chunk.
	Progress func(copied, total int64)
}

// Rebuild brings back the replica name, which left the in-sync set, over
// peer (a new connection to it): it copies what the replica lacks, has
// the arbiter record it in sync, and returns then. On failure the replica
// stays out and its log whole; a fenced Mirror rebuilds nothing.
func (m *Mirror) Rebuild(ctx context.Context, name string, conn Peer, o RebuildOptions) error {
	m.lackMu.Lock()
	locked := true
	defer func() {
		if locked {
			m.lackMu.Unlock()
		}
	}()
	m.mu.Lock()
	var p *peer
	for _, q := range m.peers {
		if q.name == name {
			p = q
		}
	}
	switch {
	case m.fenced != nil:
		m.mu.Unlock()
		conn.Close()
		return fmt.Errorf("replica: rebuilding %s: %w", name, nbd.ErrWithheld)
	case p == nil:
		m.mu.Unlock()
		conn.Close()
		return fmt.Errorf("replica: rebuilding %s: no such replica", name)
	case p.state != out || p.log == nil:
		m.mu.Unlock()
		conn.Close()
		return fmt.Errorf("replica: rebuilding %s: it is not out of the in-sync set", name)
	}
	p.setClient(conn)
	p.unflushed, p.flushing = &chunks{}, nil
	p.state = rebuilding
	p.copied, p.total = 0, 0
	m.mu.Unlock()
	m.changed(p)

	// A change that chose its targets before p was being rebuilt marked
	// p's log before lackMu was ours, so it is in what is copied below
	// (and the copy of its chunk waits for it); one that chooses them
	// after forwards to p.
	todo := p.log.Ranges()
	m.lackMu.Unlock()
	locked = false
	var total int64
	for _, r := range todo {
		total += r.Len
	}
	m.log.Info("rebuilding a replica", "replica", name, "bytes", total)
	start := time.Now()
	// Up to rebuildInFlight chunks are copied at once: one at a time
	// the copy runs at a chunk per round trip, a fraction of the line.
	var (
		mu           sync.Mutex
		copied, sent int64
		failed       error
		wg           sync.WaitGroup
	)
	slots := make(chan []byte, rebuildInFlight)
	for range rebuildInFlight {
		slots <- make([]byte, Chunk)
	}
	copyAt := func(off int64, buf []byte) {
		defer wg.Done()
		n, err := m.copyChunk(p, off, buf)
		slots <- buf
		mu.Lock()
		defer mu.Unlock()
		if err != nil {
			if failed == nil {
				failed = fmt.Errorf("copying at %d: %w", off, err)
			}
			return
		}
		copied += Chunk
		sent += n
		m.mu.Lock()
		p.copied, p.total = copied, total
		m.mu.Unlock()
		if o.Progress != nil {
			o.Progress(copied, total)
		}
	}
	var stop error
copy:
	for _, r := range todo {
		for off := r.Off; off < r.Off+r.Len; off += Chunk {
			if stop = m.rebuilding(ctx, p); stop != nil {
				break copy
			}
			buf := <-slots
			mu.Lock()
			err, done := failed, sent
			mu.Unlock()
			if err != nil {
				slots <- buf
				break copy
			}
			wg.Add(1)
			go copyAt(off, buf)
			// The rate bounds the data sent: a chunk of zeroes costs the
			// line a request header.
			if o.Rate > 0 {
				ahead := time.Duration(float64(done)/o.Rate*float64(time.Second)) - time.Since(start)
				if ahead > 0 {
					select {
					case <-ctx.Done():
					case <-time.After(ahead):
					}
				}
			}
		}
	}
	wg.Wait()
	if stop != nil {
		return stop
	}
	if failed != nil {
		m.failed(p, failed)
		return fmt.Errorf("%w: replica %s: %v", ErrRebuildAborted, name, failed)
	}

	// Durable on the replica, then back in sync by the arbiter's record.
	m.mu.Lock()
	m.flushSeq++
	seq := m.flushSeq
	p.flushing = append(p.flushing, flushSnap{seq, p.unflushed})
	p.unflushed = &chunks{}
	m.mu.Unlock()
	m.flushPeer(p, seq)
	if err := m.rebuilding(ctx, p); err != nil {
		return err
	}
	return m.rejoin(ctx, p, time.Since(start), copied)
}

// rebuildInFlight is how many chunks a rebuild copies at once.
const rebuildInFlight = 16

// rebuilding fails when p's rebuild cannot go on (it failed, or ctx or
// the Mirror ended); a rebuild that ctx ended leaves p out.
func (m *Mirror) rebuilding(ctx context.Context, p *peer) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	switch {
	case p.state != rebuilding:
		return fmt.Errorf("%w: replica %s: %v", ErrRebuildAborted, p.name, p.cause)
	case ctx.Err() != nil || m.ctx.Err() != nil:
		p.state = out
		p.client().Close()
		return fmt.Errorf("%w: replica %s: %v", ErrRebuildAborted, p.name, cmp.Or(ctx.Err(), m.ctx.Err()))
	}
	return nil
}

// copyChunk copies the chunk at off from the primary's copy to p, under a
// claim of the chunk: no change to it lands between the read and the
// write. A chunk of zeroes (a hole of a sparse copy, most of a new
// volume's) goes as a WRITE_ZEROES, which carries no data and lets the
// replica keep its file sparse. It returns the data bytes it sent.
func (m *Mirror) copyChunk(p *peer, off int64, buf []byte) (int64, error) {
	defer m.claim(off, Chunk)()
	n := min(int64(len(buf)), m.local.Size()-off)
	if n <= 0 {
		return 0, nil
	}
	if _, err := m.local.ReadAt(buf[:n], off); err != nil && !errors.Is(err, io.EOF) {
		return 0, fmt.Errorf("reading the primary's copy: %w", err)
	}
	c := p.client()
	if n%zeroesAlign == 0 && allZero(buf[:n]) {
		return 0, m.call(c, func() error { return c.WriteZeroes(off, n, false) })
	}
	return n, m.call(c, func() error {
		_, err := c.WriteAt(buf[:n], off)
		return err
	})
}

// zeroesAlign: a chunk is sent as WRITE_ZEROES only when its length is a
// multiple of this (every block size an export announces divides it).
const zeroesAlign = 4096

// allZero reports whether b holds only zero bytes.
func allZero(b []byte) bool {
	for len(b) >= 8 {
		if binary.NativeEndian.Uint64(b) != 0 {
			return false
		}
		b = b[8:]
	}
	for _, x := range b {
		if x != 0 {
			return false
		}
	}
	return true
}

// rejoin has the arbiter record p in sync again. From the moment p counts
// as in sync here, a failure of it is a drop (queued behind this
// decision), and its log is still marked until the decision is recorded.
func (m *Mirror) rejoin(ctx context.Context, p *peer, took time.Duration, copied int64) error {
	m.decide.Lock()
	defer m.decide.Unlock()
	m.mu.Lock()
	if p.state != rebuilding {
		m.mu.Unlock()
		return fmt.Errorf("%w: replica %s: %v", ErrRebuildAborted, p.name, p.cause)
	}
	p.state = inSync
	m.mu.Unlock()
	next, err := m.record(ctx, "that replica "+p.name+" is back in sync", func(ctx context.Context, epoch int64) (int64, error) {
		return m.arb.Rejoin(ctx, epoch, p.name)
	})
	switch {
	case err == nil:
		m.mu.Lock()
		l := p.log
		if p.state != inSync {
			// It failed meanwhile: its drop, queued behind this
			// decision, goes on with the log.
			m.mu.Unlock()
			return fmt.Errorf("%w: replica %s failed as it rejoined: %v", ErrRebuildAborted, p.name, p.cause)
		}
		p.log = nil
		m.mu.Unlock()
		l.Close()
		if m.logDir != "" {
			if err := os.Remove(m.logPath(p.name)); err != nil && !errors.Is(err, os.ErrNotExist) {
				m.log.Warn("cannot remove the log of a replica back in sync", "replica", p.name, "error", err)
			}
		}
		m.log.Info("a replica is back in the in-sync set", "replica", p.name, "epoch", next,
			"copied_bytes", copied, "took", took.Round(time.Millisecond))
		m.changed(p)
		return nil
	case errors.Is(err, nbd.ErrSuperseded), errors.Is(err, nbd.ErrWithheld):
		return fmt.Errorf("replica: rejoining %s: %w", p.name, err)
	}
	// Given up: the replica is out again. Its log was marked by every
	// change since the rebuild began, so it is whole.
	m.mu.Lock()
	if p.state == inSync {
		p.state = out
		p.client().Close()
	}
	m.mu.Unlock()
	return fmt.Errorf("%w: replica %s: the arbiter was not reached", ErrRebuildAborted, p.name)
}
