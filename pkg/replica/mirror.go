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

// Package replica keeps a volume's copies on several storage nodes in
// step: the primary's side of replication (docs/replication.md).
//
// A Mirror is the backend a primary's export serves: it applies every
// change to the primary's own copy and forwards it, in parallel, to every
// replica of the in-sync set, and reports it done only when all have it.
// A replica that fails a forward, or leaves one unanswered past the
// deadline, leaves the in-sync set by a decision of the Arbiter, recorded
// before the change that replica lacks is acknowledged; from then on a
// DirtyLog records what it lacks, for its rebuild. A primary whose
// decisions the arbiter refuses (a newer epoch exists: another primary)
// or cannot record (unreachable) acknowledges nothing more: it withholds
// the answers (nbd.ErrWithheld), so nodes replay their requests on the
// replica that is primary now.
package replica

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"os"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/mpnbd/mpnbd/internal/backoff"
	"github.com/mpnbd/mpnbd/pkg/nbd"
)

// Peer is one replica of the in-sync set, as the primary forwards changes
// to it. Its calls may run concurrently. Close makes the calls in flight
// return (with an error) promptly.
type Peer interface {
	WriteAt(p []byte, off int64) (int, error)
	Trim(off, n int64) error
	WriteZeroes(off, n int64, noHole bool) error
	Flush() error
	Close() error
}

// Arbiter records the decisions that change a volume's in-sync set
// (docs/replication.md: the NBDVolume, updated conditionally).
type Arbiter interface {
	// Drop records that replica leaves the in-sync set of epoch and
	// returns the epoch of that decision (higher). An error wrapping
	// nbd.ErrSuperseded says epoch is not the current one any more (a
	// newer decision, such as another primary, came first): final. Any
	// other error is passing (the arbiter unreachable): try again.
	Drop(ctx context.Context, epoch int64, replica string, cause error) (int64, error)
	// Rejoin records that replica, rebuilt, is in the in-sync set of
	// epoch again, and returns the epoch of that decision. Its errors
	// are Drop's.
	Rejoin(ctx context.Context, epoch int64, replica string) (int64, error)
}

// DefaultDeadline is how long a forward may stay unanswered before its
// replica counts as failed: above a loaded disk's sync and a path's
// retransmission after a loss, below the node's own dead-peer bound, so
// that a dead replica costs a pause, not a failover of the primary.
const DefaultDeadline = 4 * time.Second

// arbiterTimeout bounds one call to the arbiter.
const arbiterTimeout = 5 * time.Second

// Config makes a Mirror.
type Config struct {
	// Local is the primary's own copy.
	Local nbd.Backend
	// Peers are the other replicas of the in-sync set, by name.
	Peers map[string]Peer
	// Out are the other replicas, out of the in-sync set as the record
	// stands: what each lacks is its log in LogDir, kept since it left
	// (a primary that restarts finds it there); a replica without one
	// lacks everything (a full copy rebuilds it). Rebuild brings them
	// back.
	Out []string
	// Epoch is the replica epoch the in-sync set was recorded with.
	Epoch   int64
	Arbiter Arbiter
	// Deadline bounds a forward's answer; zero means DefaultDeadline.
	Deadline time.Duration
	// LogDir keeps the dirty logs of the replicas that leave, one file
	// each (<name>.dirty); empty keeps them in memory only.
	LogDir string
	// MarkInterval is how often settle marks go to each replica
	// (DefaultMarkInterval when zero; negative: none).
	MarkInterval time.Duration
	// OnChange, when set, is called (never under the Mirror's locks)
	// with a replica's new state when it changes: its leaving or return
	// recorded, its rebuild begun or failed. Calls for one replica come
	// in order.
	OnChange func(ReplicaState)
	Logger   *slog.Logger
}

// replicaState is where a peer stands.
type replicaState int

const (
	inSync     replicaState = iota
	dropping                // failed; its decision is being recorded
	out                     // left the in-sync set
	rebuilding              // out, being brought back (rebuild.go)
)

// peer is one replica as the Mirror tracks it.
type peer struct {
	name string
	// p is the connection to the replica, replaced by a rebuild: read
	// and written through client and setClient (pmu, a leaf lock), as
	// the forwards in flight read it while a rebuild sets it.
	pmu   sync.Mutex
	p     Peer
	state replicaState
	// decided is closed once the replica is out, or the Mirror fenced.
	decided chan struct{}
	// unflushed: chunks changed since the last FLUSH the replica
	// started; flushing: those covered by FLUSHes in flight, by number.
	// When the replica leaves, all of them go into its log: what it
	// acknowledged but had not made durable may be lost with it.
	unflushed *chunks
	flushing  []flushSnap
	// log: what it lacks, set once it fails; kept (and marked ahead of
	// every change) until its rejoining is recorded.
	log   *DirtyLog
	cause error
	// flushMu sends its FLUSHes one at a time (flushPeer).
	flushMu sync.Mutex
	// copied and total: the rebuild under way's progress, in bytes.
	copied, total int64
	// marks: the settle marks on its connection (marks.go).
	marks marks
}

type flushSnap struct {
	seq uint64
	c   *chunks
}

// Mirror is a replicated volume's backend on its primary. It implements
// nbd.Backend.
type Mirror struct {
	local    nbd.Backend
	arb      Arbiter
	onChange func(ReplicaState)
	deadline time.Duration
	logDir   string
	log      *slog.Logger

	// decide serialises the arbiter calls: each names the epoch the
	// previous one made.
	decide sync.Mutex
	// lackMu: a change holds it (read) from choosing its targets until
	// the replicas out of the set have it in their logs; a rebuild takes
	// it to turn its replica to rebuilding and read the log, so that a
	// change that found the replica out is in what the rebuild copies.
	lackMu sync.RWMutex

	// claims are the byte ranges of the changes (and rebuild copies)
	// under way: one that overlaps another waits for it (claim.go).
	claimMu sync.Mutex
	claims  []*claim

	mu       sync.Mutex
	epoch    int64
	peers    []*peer
	flushSeq uint64
	fenced   error // non-nil: nothing is acknowledged any more
	closed   bool
	ctx      context.Context
	cancel   context.CancelFunc
}

// New returns a Mirror over cfg.Local and cfg.Peers.
func New(cfg Config) (*Mirror, error) {
	if cfg.Local == nil || cfg.Arbiter == nil {
		return nil, errors.New("replica: a Mirror needs a local backend and an arbiter")
	}
	m := &Mirror{
		local:    cfg.Local,
		arb:      cfg.Arbiter,
		onChange: cfg.OnChange,
		deadline: cmp.Or(cfg.Deadline, DefaultDeadline),
		logDir:   cfg.LogDir,
		log:      cmp.Or(cfg.Logger, slog.Default()),
		epoch:    cfg.Epoch,
	}
	m.ctx, m.cancel = context.WithCancel(context.Background())
	for _, name := range slices.Sorted(maps.Keys(cfg.Peers)) {
		m.peers = append(m.peers, &peer{name: name, p: cfg.Peers[name], unflushed: &chunks{}})
	}
	for _, name := range cfg.Out {
		if _, ok := cfg.Peers[name]; ok {
			m.closeLogs()
			return nil, fmt.Errorf("replica: %s is both in sync and out", name)
		}
		l, err := m.outLog(name)
		if err != nil {
			m.closeLogs()
			return nil, err
		}
		m.peers = append(m.peers, &peer{name: name, p: absent{}, state: out, log: l, unflushed: &chunks{},
			cause: errors.New("out of the in-sync set when the primary started")})
	}
	slices.SortFunc(m.peers, func(a, b *peer) int { return strings.Compare(a.name, b.name) })
	if every := cmp.Or(cfg.MarkInterval, DefaultMarkInterval); every > 0 {
		go m.sendMarks(every)
	}
	return m, nil
}

// markTick is how often the Mirror looks for marks due: the first two of
// a connection go within a tick or two.
const markTick = 100 * time.Millisecond

// sendMarks sends each replica in sync or being rebuilt a settle mark
// every interval (the first two of a connection at once), until the
// Mirror closes. A replica that refuses marks
// (EINVAL: an agent of an older release) gets none on that connection;
// any other failure is the forwards' to find.
func (m *Mirror) sendMarks(every time.Duration) {
	t := time.NewTicker(min(every, markTick))
	defer t.Stop()
	for {
		select {
		case <-m.ctx.Done():
			return
		case <-t.C:
		}
		m.mu.Lock()
		var live []*peer
		for _, p := range m.peers {
			if p.state == inSync || p.state == rebuilding {
				live = append(live, p)
			}
		}
		m.mu.Unlock()
		now := time.Now()
		for _, p := range live {
			c := p.client()
			s, ok := c.(Settler)
			if !ok || !p.marks.due(c, now, every) {
				continue
			}
			err := p.marks.mark(c, func(mark, settled uint64) error {
				return m.call(c, func() error { return s.Settle(mark, uint32(settled)) })
			})
			var ne *nbd.Error
			if errors.As(err, &ne) && ne.Errno == nbd.EINVAL {
				m.log.Info("a replica takes no settle marks (an agent of an older release)", "replica", p.name)
			}
		}
	}
}

// outLog is the log of a replica out of the in-sync set at the start: the
// one kept in LogDir since it left, or, without one, a log of the whole
// volume.
func (m *Mirror) outLog(name string) (*DirtyLog, error) {
	if m.logDir != "" {
		path := m.logPath(name)
		_, statErr := os.Stat(path)
		l, err := OpenLog(path)
		if err != nil || statErr == nil {
			return l, err
		}
		if err := l.Mark(0, m.local.Size()); err != nil {
			l.Close()
			return nil, err
		}
		return l, nil
	}
	l := NewMemoryLog()
	return l, l.Mark(0, m.local.Size())
}

// closeLogs closes the logs opened so far (New failing).
func (m *Mirror) closeLogs() {
	for _, p := range m.peers {
		if p.log != nil {
			p.log.Close()
		}
	}
}

// absent is the Peer of a replica not connected: out of the in-sync set
// until a Rebuild gives it a connection.
type absent struct{}

var errAbsent = errors.New("replica: not connected")

func (absent) WriteAt([]byte, int64) (int, error)   { return 0, errAbsent }
func (absent) Trim(int64, int64) error              { return errAbsent }
func (absent) WriteZeroes(int64, int64, bool) error { return errAbsent }
func (absent) Flush() error                         { return errAbsent }
func (absent) Close() error                         { return nil }

// Epoch is the replica epoch of the latest decision this Mirror made or
// started with.
func (m *Mirror) Epoch() int64 {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.epoch
}

// InSync lists the peers still in the in-sync set (the primary itself not
// included), sorted.
func (m *Mirror) InSync() []string {
	m.mu.Lock()
	defer m.mu.Unlock()
	var out []string
	for _, p := range m.peers {
		if p.state == inSync {
			out = append(out, p.name)
		}
	}
	return out
}

// ReplicaState is where one replica stands, as its primary sees it.
type ReplicaState struct {
	Name string
	// State is "InSync", "Leaving" (failed, its leaving being recorded),
	// "Out" or "Rebuilding".
	State string
	// Lacking is what it lacks, in bytes (0 in sync).
	Lacking int64
	// Copied and Total are a rebuild's progress, in bytes.
	Copied, Total int64
}

// Replicas lists where each replica stands, by name.
func (m *Mirror) Replicas() []ReplicaState {
	m.mu.Lock()
	defer m.mu.Unlock()
	list := make([]ReplicaState, 0, len(m.peers))
	for _, p := range m.peers {
		list = append(list, p.stateLocked())
	}
	return list
}

// stateLocked is where p stands (m.mu held).
func (p *peer) stateLocked() ReplicaState {
	st := ReplicaState{Name: p.name, State: [...]string{inSync: "InSync", dropping: "Leaving", out: "Out", rebuilding: "Rebuilding"}[p.state]}
	if p.log != nil && p.state != inSync {
		st.Lacking = p.log.Bytes()
	}
	if p.state == rebuilding {
		st.Copied, st.Total = p.copied, p.total
	}
	return st
}

// changed tells OnChange where p stands now. Its calls for one replica
// are in order: each follows the change it reports, made under decide
// or by the one rebuild of p under way.
func (m *Mirror) changed(p *peer) {
	if m.onChange == nil {
		return
	}
	m.mu.Lock()
	st := p.stateLocked()
	m.mu.Unlock()
	m.onChange(st)
}

// Lacking returns the log of what a replica that left the in-sync set
// lacks, or nil for one that is in sync (or unknown).
func (m *Mirror) Lacking(name string) *DirtyLog {
	m.mu.Lock()
	defer m.mu.Unlock()
	for _, p := range m.peers {
		if p.name == name && p.state == out {
			return p.log
		}
	}
	return nil
}

// Fenced returns why the Mirror acknowledges nothing any more, or nil.
func (m *Mirror) Fenced() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.fenced
}

// ReadAt reads the primary's own copy: every acknowledged change is in it.
func (m *Mirror) ReadAt(p []byte, off int64) (int, error) { return m.local.ReadAt(p, off) }

// Size is the primary's copy's size.
func (m *Mirror) Size() int64 { return m.local.Size() }

// Resize resizes the primary's own copy only: the replicas' agents resize
// theirs first (a forward beyond a replica's end fails it).
func (m *Mirror) Resize(size int64) error { return m.local.Resize(size) }

// WriteAt writes p at off on every replica of the in-sync set.
func (m *Mirror) WriteAt(p []byte, off int64) (int, error) {
	err := m.change(off, int64(len(p)), func() error {
		_, err := m.local.WriteAt(p, off)
		return err
	}, func(r Peer) error {
		_, err := r.WriteAt(p, off)
		return err
	})
	if err != nil {
		return 0, err
	}
	return len(p), nil
}

// Trim discards a range on every replica of the in-sync set.
func (m *Mirror) Trim(off, n int64) error {
	return m.change(off, n, func() error { return m.local.Trim(off, n) },
		func(r Peer) error { return r.Trim(off, n) })
}

// Zero zeroes a range on every replica of the in-sync set.
func (m *Mirror) Zero(off, n int64, noHole bool) error {
	return m.change(off, n, func() error { return m.local.Zero(off, n, noHole) },
		func(r Peer) error { return r.WriteZeroes(off, n, noHole) })
}

// change applies one change locally and on every in-sync replica, and
// returns once each has it or has left the in-sync set by a recorded
// decision. It returns nbd.ErrWithheld when the Mirror is fenced before
// that.
func (m *Mirror) change(off, n int64, local func() error, fwd func(Peer) error) error {
	defer m.claim(off, n)()
	// Held until the replicas out of the set have this change in their
	// logs: a rebuild starting meanwhile must find it there.
	m.lackMu.RLock()
	m.mu.Lock()
	if m.fenced != nil {
		m.mu.Unlock()
		m.lackMu.RUnlock()
		return nbd.ErrWithheld
	}
	var targets, lacking []*peer
	for _, p := range m.peers {
		switch p.state {
		case inSync, rebuilding:
			p.unflushed.mark(off, n)
			targets = append(targets, p)
			if p.log != nil {
				// Being rebuilt or rejoining: until the arbiter has
				// it back in sync, its log keeps what it may lack.
				lacking = append(lacking, p)
			}
		default:
			lacking = append(lacking, p)
		}
	}
	m.mu.Unlock()

	// Those out of the set lack this change: recorded (durably) before
	// it is acknowledged.
	for _, p := range lacking {
		if err := m.markLacking(p, off, n); err != nil {
			m.lackMu.RUnlock()
			return err
		}
	}
	m.lackMu.RUnlock()
	toks := make([]markToken, len(targets))
	done := m.forward(targets, toks, fwd)
	lerr := local()
	<-done
	m.markAgain(targets, off, n)
	err := m.settle(lerr)
	// Settled: in sync everywhere, or recorded out where it is not.
	for i, p := range targets {
		p.marks.end(toks[i])
	}
	return err
}

// markAgain marks a change as unflushed again on the targets that have it
// now, and as lacking on those that failed it. The mark made as the change
// started may have been taken by a FLUSH that reached the replica ahead of
// the change, which does not make the change durable there; marked again,
// the next FLUSH covers it, and a replica that fails before then (or that
// failed the change) has it in what it lacks. Held under lackMu (read), as
// the marks made at the start: a rebuild then finds it in the log it copies
// from. A log that cannot be written fences the Mirror (markLacking), and
// settle then withholds the answer.
func (m *Mirror) markAgain(targets []*peer, off, n int64) {
	m.lackMu.RLock()
	defer m.lackMu.RUnlock()
	for _, p := range targets {
		m.mu.Lock()
		has := p.state == inSync || p.state == rebuilding
		if has {
			p.unflushed.mark(off, n)
		}
		m.mu.Unlock()
		if !has && m.markLacking(p, off, n) != nil {
			return
		}
	}
}

// testHookMarkLacking, set by tests, runs as a change starts marking a
// replica's log.
var testHookMarkLacking func()

// markLacking records that p lacks [off, off+n). A log that cannot be
// written fences the Mirror: acknowledging the change would lose track of
// it.
func (m *Mirror) markLacking(p *peer, off, n int64) error {
	if h := testHookMarkLacking; h != nil {
		h()
	}
	m.mu.Lock()
	l := p.log
	if l == nil {
		// Still dropping: its log is being made; the chunk goes in its
		// unflushed set, which the log takes in.
		p.unflushed.mark(off, n)
	}
	m.mu.Unlock()
	if l == nil {
		return nil
	}
	if err := l.Mark(off, n); err != nil {
		m.fence(fmt.Errorf("replica %s: %w", p.name, err))
		return nbd.ErrWithheld
	}
	return nil
}

// client is p's connection as it is now.
func (p *peer) client() Peer {
	p.pmu.Lock()
	defer p.pmu.Unlock()
	return p.p
}

// setClient makes c p's connection.
func (p *peer) setClient(c Peer) {
	p.pmu.Lock()
	p.p = c
	p.pmu.Unlock()
}

// forward runs fwd on every target at once, each bounded by the
// deadline, and returns a channel closed once all have answered. A target
// that fails (or is past the deadline: closed, which ends its call) has
// its drop started before the channel closes. Each forward is counted for
// the target's settle marks (toks[i], to end once the change settles).
func (m *Mirror) forward(targets []*peer, toks []markToken, fwd func(Peer) error) <-chan struct{} {
	done := make(chan struct{})
	if len(targets) == 0 {
		close(done)
		return done
	}
	var wg sync.WaitGroup
	for i, p := range targets {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c := p.client()
			toks[i] = p.marks.begin(c)
			err := m.call(c, func() error { return fwd(c) })
			p.marks.answered()
			if err != nil {
				m.failed(p, err)
			}
		}()
	}
	go func() { wg.Wait(); close(done) }()
	return done
}

// errDeadline: a forward left unanswered past the deadline.
var errDeadline = errors.New("replica: no answer within the deadline")

// call runs f against a replica's connection c, bounded by the deadline:
// past it c is closed (its calls in flight then return) and the call
// counts as failed.
func (m *Mirror) call(c Peer, f func() error) error {
	late := time.AfterFunc(m.deadline, func() { c.Close() })
	err := f()
	if !late.Stop() {
		return fmt.Errorf("%w (%v)", errDeadline, m.deadline)
	}
	return err
}

// settle returns the verdict of a change or FLUSH whose forwards are
// done: it waits until no replica's leaving is undecided (whichever
// request found it failed: a replica that failed anything may have lost
// what it acknowledged, for this request as for the others), and withholds
// the answer if the Mirror is fenced by then.
func (m *Mirror) settle(lerr error) error {
	for {
		m.mu.Lock()
		var wait chan struct{}
		for _, p := range m.peers {
			if p.state == dropping {
				wait = p.decided
				break
			}
		}
		fenced := m.fenced != nil
		m.mu.Unlock()
		if fenced {
			return nbd.ErrWithheld
		}
		if wait == nil {
			return lerr
		}
		<-wait
	}
}

// startDrop starts the decision that p leaves the in-sync set (unless it
// is under way or made) and returns the channel closed once it is made.
func (m *Mirror) startDrop(p *peer, cause error) chan struct{} {
	m.mu.Lock()
	defer m.mu.Unlock()
	if p.state != inSync {
		return p.decided
	}
	p.state = dropping
	p.cause = cause
	p.decided = make(chan struct{})
	if m.fenced != nil {
		close(p.decided)
		return p.decided
	}
	m.log.Warn("a replica failed: recording that it leaves the in-sync set before acknowledging what it lacks", "replica", p.name, "error", cause)
	go m.drop(p)
	return p.decided
}

// drop makes p's log (what it lacks: every chunk changed since its last
// completed FLUSH began), then records its leaving with the arbiter,
// trying again while the arbiter is unreachable. A refusal (superseded)
// fences the Mirror.
func (m *Mirror) drop(p *peer) {
	p.client().Close()
	m.mu.Lock()
	l := p.log
	m.mu.Unlock()
	var err error
	switch {
	case l != nil:
		// Rejoining: its log is kept until the arbiter has it back.
	case m.logDir != "":
		l, err = OpenLog(m.logPath(p.name))
	default:
		l = NewMemoryLog()
	}
	if err == nil {
		m.mu.Lock()
		lacks := &chunks{}
		lacks.or(p.unflushed)
		for _, s := range p.flushing {
			lacks.or(s.c)
		}
		m.mu.Unlock()
		err = l.merge(lacks)
	}
	if err != nil {
		m.fence(fmt.Errorf("replica %s: cannot record what it lacks: %w", p.name, err))
		return
	}
	// Changes that arrived while the log was being made went to
	// unflushed (markLacking): take them in under the lock that hands
	// the log over, so none is missed.
	m.mu.Lock()
	rest := p.unflushed
	p.unflushed = &chunks{}
	p.log = l
	m.mu.Unlock()
	if err := l.merge(rest); err != nil {
		m.fence(fmt.Errorf("replica %s: cannot record what it lacks: %w", p.name, err))
		return
	}

	m.decide.Lock()
	defer m.decide.Unlock()
	next, err := m.record(m.ctx, "that replica "+p.name+" left the in-sync set", func(ctx context.Context, epoch int64) (int64, error) {
		return m.arb.Drop(ctx, epoch, p.name, p.cause)
	})
	if err != nil {
		// Refused (fenced by record) or the Mirror closed meanwhile.
		m.fence(fmt.Errorf("replica %s: its leaving was not recorded: %w", p.name, err))
		return
	}
	m.mu.Lock()
	p.state = out
	close(p.decided)
	m.mu.Unlock()
	m.log.Warn("a replica left the in-sync set", "replica", p.name, "epoch", next, "lacks_bytes", l.Bytes())
	m.changed(p)
}

// record has the arbiter record one decision (ask, given the current
// epoch), trying again while the arbiter cannot be reached, until it is
// recorded (the epoch it made is the Mirror's), refused (superseded: the
// Mirror is fenced) or ctx or the Mirror ends. Called with decide held.
func (m *Mirror) record(ctx context.Context, what string, ask func(ctx context.Context, epoch int64) (int64, error)) (int64, error) {
	pause := backoff.New(50*time.Millisecond, 2*time.Second)
	for {
		m.mu.Lock()
		epoch, fenced := m.epoch, m.fenced
		m.mu.Unlock()
		if fenced != nil {
			return 0, nbd.ErrWithheld
		}
		actx, cancel := context.WithTimeout(m.ctx, arbiterTimeout)
		next, err := ask(actx, epoch)
		cancel()
		if err == nil {
			m.mu.Lock()
			m.epoch = next
			m.mu.Unlock()
			return next, nil
		}
		if errors.Is(err, nbd.ErrSuperseded) {
			m.fence(fmt.Errorf("the arbiter refused to record %s at epoch %d: %w", what, epoch, err))
			return 0, err
		}
		m.log.Warn("cannot record a decision with the arbiter: acknowledging nothing it concerns until it answers", "decision", what, "error", err)
		select {
		case <-ctx.Done():
			return 0, ctx.Err()
		case <-m.ctx.Done():
			return 0, m.ctx.Err()
		case <-time.After(pause.Next()):
		}
	}
}

// fence makes the Mirror acknowledge nothing any more and wakes every
// change waiting for a decision.
func (m *Mirror) fence(why error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.fenced != nil {
		return
	}
	m.fenced = why
	m.log.Error("replicated volume fenced: withholding every answer, so that nodes replay their requests on the primary that replaced this one", "reason", why)
	for _, p := range m.peers {
		switch p.state {
		case dropping:
			close(p.decided)
			p.state = out
		case rebuilding:
			p.state = out
		}
		p.client().Close()
	}
}

// Sync makes every completed change durable on the primary's copy and on
// every replica of the in-sync set (a FLUSH to each).
func (m *Mirror) Sync() error {
	m.mu.Lock()
	if m.fenced != nil {
		m.mu.Unlock()
		return nbd.ErrWithheld
	}
	m.flushSeq++
	seq := m.flushSeq
	var targets []*peer
	for _, p := range m.peers {
		if p.state == inSync || p.state == rebuilding {
			p.flushing = append(p.flushing, flushSnap{seq, p.unflushed})
			p.unflushed = &chunks{}
			targets = append(targets, p)
		}
	}
	m.mu.Unlock()

	var wg sync.WaitGroup
	for _, p := range targets {
		wg.Add(1)
		go func() {
			defer wg.Done()
			m.flushPeer(p, seq)
		}()
	}
	lerr := m.local.Sync()
	wg.Wait()
	return m.settle(lerr)
}

// flushPeer sends FLUSH number seq to p, one at a time per replica: a
// replica reports a writeback error to one FLUSH only (and our server, to
// one per connection), so a FLUSH that succeeds after another failed proves
// nothing of what the failure lost. Sent one after the other, a failure's
// drop has started before the next FLUSH goes, and that one then does not
// count.
func (m *Mirror) flushPeer(p *peer, seq uint64) {
	p.flushMu.Lock()
	defer p.flushMu.Unlock()
	m.mu.Lock()
	state := p.state
	m.mu.Unlock()
	if state != inSync && state != rebuilding {
		return
	}
	c := p.client()
	if err := m.call(c, c.Flush); err != nil {
		m.failed(p, err)
		return
	}
	m.flushed(p, seq)
}

// flushed forgets the chunks a completed FLUSH numbered seq made durable
// on p: those of it and of every earlier one.
func (m *Mirror) flushed(p *peer, seq uint64) {
	m.mu.Lock()
	defer m.mu.Unlock()
	p.flushing = slices.DeleteFunc(p.flushing, func(s flushSnap) bool { return s.seq <= seq })
}

// Close closes the peers and the logs, and the local backend.
func (m *Mirror) Close() error {
	m.mu.Lock()
	if m.closed {
		m.mu.Unlock()
		return nil
	}
	m.closed = true
	m.mu.Unlock()
	m.cancel()
	for _, p := range m.peers {
		p.client().Close()
	}
	m.decide.Lock() // no decision in flight uses a log being closed
	m.mu.Lock()
	for _, p := range m.peers {
		if p.log != nil {
			p.log.Close()
		}
	}
	m.mu.Unlock()
	m.decide.Unlock()
	return m.local.Close()
}
