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
	"math/bits"
	"sync/atomic"
	"time"

	"github.com/mpnbd/mpnbd/pkg/nbd"
)

// Latency counts the requests of the local side a relay answered, by
// command, by how long each took and by how it ended. A request's time
// runs from the relay reading its header (or the in-process caller
// starting it) to its answer going to the local side, whatever the
// answer: a reply of the server, a reply after the request was sent again
// on a new connection (the outage included), EIO once the outage outlasts
// FailAfter, or the end of the relay while it waited. The relay's own
// requests (its FLUSHes, retained writes sent again) are not counted.
//
// Recording takes a few atomic additions and allocates nothing; a
// snapshot (Requests) is the caller's to turn into metrics, in this
// process or after crossing to another one.
type Latency struct {
	ops [latencyOps]opLatency
}

type opLatency struct {
	// buckets[i] counts the requests of at most LatencyBounds[i] (and
	// more than the bound before); the last those of more than every
	// bound.
	buckets  [len(LatencyBounds) + 1]atomic.Uint64
	sumNanos atomic.Uint64
	results  [numResults]atomic.Uint64
}

// NewLatency returns an empty Latency. Several relays may share one (a
// volume's relays, one after another): their counts add up.
func NewLatency() *Latency { return new(Latency) }

// Request outcomes, by what answered the local side.
const (
	// resultOK: the server's reply, a success.
	resultOK = iota
	// resultError: the server's reply, an error (or a FLUSH failed for a
	// failed flush of the relay's own).
	resultError
	// resultFailed: the relay's own EIO, or the relay ending, without a
	// reply of the server.
	resultFailed
	numResults
)

// latencyOps are the NBD commands counted apart (read .. block_status);
// any other counts as "other".
const latencyOps = int(nbd.CmdBlockStatus) + 2

func opIndex(cmd uint16) int {
	if int(cmd) < latencyOps-1 {
		return int(cmd)
	}
	return latencyOps - 1
}

func opName(i int) string {
	if i == latencyOps-1 {
		return "other"
	}
	return nbd.CmdName(uint16(i))
}

// latencyBase is the smallest bound: bounds double from it.
const latencyBase = 100 * time.Microsecond

// LatencyBounds are the upper bounds, in seconds, of the request
// duration buckets: 100 µs doubling up to 105 s (2^20 × 100 µs), 21
// buckets and the one beyond, few enough to store and fine enough for a
// p99 within a factor of two from a local SSD to an outage.
var LatencyBounds = func() [21]float64 {
	var b [21]float64
	for i := range b {
		b[i] = float64(latencyBase<<i) / float64(time.Second)
	}
	return b
}()

// bucketIndex is the bucket of a request that took d: the first bound d
// does not exceed, computed rather than searched since the bounds double.
func bucketIndex(d time.Duration) int {
	if d <= latencyBase {
		return 0
	}
	return min(bits.Len64(uint64(d-1)/uint64(latencyBase)), len(LatencyBounds))
}

func (l *Latency) observe(cmd uint16, d time.Duration, result int) {
	o := &l.ops[opIndex(cmd)]
	o.buckets[bucketIndex(d)].Add(1)
	o.sumNanos.Add(uint64(max(d, 0)))
	o.results[result].Add(1)
}

// RequestStats are the requests of one command a relay answered.
type RequestStats struct {
	// Op is the command: read, write, flush, trim, write_zeroes, ... or
	// other.
	Op string `json:"op"`
	// Buckets counts the requests by duration: Buckets[i] those of at
	// most LatencyBounds[i] and more than the bound before, the last
	// those longer than every bound. Count is their sum.
	Buckets []uint64 `json:"buckets"`
	// Sum is the time the requests took, all together.
	Sum time.Duration `json:"sum"`
	// OK counts the successful replies of the server; Errors its error
	// replies; Failed the requests the relay failed itself (EIO after
	// FailAfter, the relay ending).
	OK     uint64 `json:"ok,omitempty"`
	Errors uint64 `json:"errors,omitempty"`
	Failed uint64 `json:"failed,omitempty"`
}

// Count is the number of requests.
func (s RequestStats) Count() uint64 {
	var n uint64
	for _, b := range s.Buckets {
		n += b
	}
	return n
}

// Requests is a snapshot, by command, of the commands seen at least
// once; nil for a nil Latency.
func (l *Latency) Requests() []RequestStats {
	if l == nil {
		return nil
	}
	var out []RequestStats
	for i := range l.ops {
		o := &l.ops[i]
		s := RequestStats{Op: opName(i), Buckets: make([]uint64, len(o.buckets))}
		var n uint64
		for j := range o.buckets {
			s.Buckets[j] = o.buckets[j].Load()
			n += s.Buckets[j]
		}
		if n == 0 {
			continue
		}
		s.Sum = time.Duration(o.sumNanos.Load())
		s.OK, s.Errors, s.Failed = o.results[resultOK].Load(), o.results[resultError].Load(), o.results[resultFailed].Load()
		out = append(out, s)
	}
	return out
}

// epoch is what request start times count from: monotonic, and never
// zero, since zero marks a request whose time was taken already.
var epoch = time.Now()

func startTime() int64 { return int64(time.Since(epoch)) + 1 }

// claim takes e's start time for its answer, and zero when it was taken
// already (or e is the relay's own). Called with mu held, so that of the
// paths that may answer one request (its reply, EIO, the relay's end)
// only the first counts it.
func claim(e *entry) int64 {
	t := e.start
	e.start = 0
	return t
}

// observe counts a request of cmd started at t (from claim; zero counts
// nothing) and answered now with result.
func (r *Relay) observe(cmd uint16, t int64, result int) {
	if t == 0 {
		return
	}
	r.latency.observe(cmd, time.Duration(startTime()-t), result)
}

// errnoResult is the outcome of a server reply with errno.
func errnoResult(errno uint32) int {
	if errno == 0 {
		return resultOK
	}
	return resultError
}
