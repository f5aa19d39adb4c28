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

package nodeattach

import (
	"bytes"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/mpnbd/mpnbd/internal/testenv/topo"
)

// The tools of the silent-path tests (silent_faults_test.go): silence on
// a path, stalls measured on a device, TCP connections seen from /proc.

// silencePaths makes paths ps (1-based) of tp drop every packet both
// ways from now on: a netem qdisc losing everything replaces the tbf
// shaping at the root of both veth ends. The links stay up and nothing
// answers, as with a dead switch or a powered-off host.
func silencePaths(tp *topo.Topology, ps ...int) error {
	return setRoots(tp, ps, func(topo.Path) []string { return []string{"netem", "loss", "100%"} })
}

// restorePaths lets paths ps carry packets again, shaped as before.
func restorePaths(tp *topo.Topology, ps ...int) error {
	return setRoots(tp, ps, func(p topo.Path) []string { return topo.TBFArgs(p.RateMbit) })
}

// setRoots replaces the root qdisc of both ends of paths ps with
// qdisc(path), one tc process per namespace: a loaded guest takes about
// a second per tc, and a host falls silent on all its paths at once.
func setRoots(tp *topo.Topology, ps []int, qdisc func(topo.Path) []string) error {
	batch := map[string]*strings.Builder{tp.ClientNS: {}, tp.ServerNS: {}}
	for _, p := range ps {
		path := tp.Paths[p-1]
		q := strings.Join(qdisc(path), " ")
		fmt.Fprintf(batch[tp.ClientNS], "qdisc replace dev %s root %s\n", path.ClientIf, q)
		fmt.Fprintf(batch[tp.ServerNS], "qdisc replace dev %s root %s\n", path.ServerIf, q)
	}
	errc := make(chan error, len(batch))
	for ns, b := range batch {
		go func() {
			cmd := exec.Command("tc", "-n", ns, "-batch", "-")
			cmd.Stdin = strings.NewReader(b.String())
			if out, err := cmd.CombinedOutput(); err != nil {
				errc <- fmt.Errorf("tc -n %s -batch: %v: %s\n%s", ns, err, bytes.TrimSpace(out), b)
				return
			}
			errc <- nil
		}()
	}
	var errs []error
	for range batch {
		if err := <-errc; err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

func allPaths(tp *topo.Topology) []int {
	var ps []int
	for i := range tp.Paths {
		ps = append(ps, i+1)
	}
	return ps
}

// busiestPath is the path of tp that carried the most bytes (both ways,
// as the client's veth ends count them) during d: the one a cut hurts.
func busiestPath(t *testing.T, tp *topo.Topology, d time.Duration) int {
	t.Helper()
	count := func() []int64 {
		var n []int64
		for _, p := range tp.Paths {
			var sum int64
			for _, f := range []string{"tx_bytes", "rx_bytes"} {
				b, err := os.ReadFile(filepath.Join("/sys/class/net", p.ClientIf, "statistics", f))
				if err != nil {
					t.Fatalf("traffic of %s: %v", p.ClientIf, err)
				}
				v, _ := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
				sum += v
			}
			n = append(n, sum)
		}
		return n
	}
	before := count()
	time.Sleep(d)
	after := count()
	best, bytes := 1, int64(-1)
	var per []string
	for i := range after {
		delta := after[i] - before[i]
		per = append(per, fmt.Sprintf("path %d: %d", i+1, delta))
		if delta > bytes {
			best, bytes = i+1, delta
		}
	}
	t.Logf("bytes per path in %v: %s", d, strings.Join(per, ", "))
	return best
}

// ioWatch samples the number of I/Os a device completed and keeps the
// times at which it grew, to measure stalls.
type ioWatch struct {
	dev  string
	mu   sync.Mutex
	grew []time.Time
	stop chan struct{}
	done chan struct{}
}

// ioTick is how often ioWatch samples: fine enough for stalls of seconds.
const ioTick = 50 * time.Millisecond

func watchIO(t *testing.T, dev string) *ioWatch {
	w := &ioWatch{dev: dev, stop: make(chan struct{}), done: make(chan struct{})}
	go func() {
		defer close(w.done)
		last := deviceIOs(dev)
		tick := time.NewTicker(ioTick)
		defer tick.Stop()
		for {
			select {
			case <-w.stop:
				return
			case now := <-tick.C:
				if n := deviceIOs(dev); n != last {
					last = n
					w.mu.Lock()
					w.grew = append(w.grew, now)
					w.mu.Unlock()
				}
			}
		}
	}()
	t.Cleanup(func() {
		close(w.stop)
		<-w.done
	})
	return w
}

// stall is the longest time without a completed I/O that overlaps
// [from, to], and when it began. A stall still going at to counts up to
// to.
func (w *ioWatch) stall(from, to time.Time) (time.Duration, time.Time) {
	w.mu.Lock()
	defer w.mu.Unlock()
	var longest time.Duration
	var began time.Time
	consider := func(a, b time.Time) {
		if b.After(from) && a.Before(to) && b.Sub(a) > longest {
			longest, began = b.Sub(a), a
		}
	}
	for i := 1; i < len(w.grew); i++ {
		consider(w.grew[i-1], w.grew[i])
	}
	if n := len(w.grew); n > 0 && w.grew[n-1].Before(to) {
		consider(w.grew[n-1], to)
	}
	return longest, began
}

// firstAfter is the first time after at that the device completed an
// I/O, if it did.
func (w *ioWatch) firstAfter(at time.Time) (time.Time, bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, g := range w.grew {
		if g.After(at) {
			return g, true
		}
	}
	return time.Time{}, false
}

// tcpConn is one TCP socket as /proc/net/tcp lists it.
type tcpConn struct {
	local, remote netip.AddrPort
	state         string // hex, as listed: 01 ESTABLISHED, 06 TIME_WAIT ...
}

// tcpStates names the states of /proc/net/tcp.
var tcpStates = map[string]string{"01": "ESTABLISHED", "02": "SYN_SENT", "03": "SYN_RECV", "04": "FIN_WAIT1",
	"05": "FIN_WAIT2", "06": "TIME_WAIT", "07": "CLOSE", "08": "CLOSE_WAIT", "09": "LAST_ACK", "0A": "LISTEN", "0B": "CLOSING"}

func (c tcpConn) String() string {
	return fmt.Sprintf("%v->%v %s", c.local, c.remote, tcpStates[c.state])
}

// tcpSocketsOf lists the TCP sockets of the network namespace of pid
// ("self" for this process's), IPv4 and IPv6; an IPv4 peer of an IPv6
// socket (a Go listener on 0.0.0.0 is one) is listed as IPv4.
func tcpSocketsOf(pid string) ([]tcpConn, error) {
	var out []tcpConn
	for _, f := range []string{"tcp", "tcp6"} {
		b, err := os.ReadFile("/proc/" + pid + "/net/" + f)
		if err != nil {
			return nil, err
		}
		for _, l := range strings.Split(string(b), "\n")[1:] {
			f := strings.Fields(l)
			if len(f) < 4 {
				continue
			}
			local, err1 := procAddr(f[1])
			remote, err2 := procAddr(f[2])
			if err1 != nil || err2 != nil {
				return nil, fmt.Errorf("/proc/%s/net/tcp: %q: %v %v", pid, l, err1, err2)
			}
			out = append(out, tcpConn{local: local, remote: remote, state: f[3]})
		}
	}
	return out, nil
}

// procAddr decodes an address of /proc/net/tcp or tcp6: "0100007F:1F90"
// is 127.0.0.1:8080 (the address in 32-bit words of host byte order,
// little endian here). A v4-mapped IPv6 address comes back as IPv4.
func procAddr(s string) (netip.AddrPort, error) {
	a, p, ok := strings.Cut(s, ":")
	if !ok || len(a) != 8 && len(a) != 32 {
		return netip.AddrPort{}, fmt.Errorf("bad address %q", s)
	}
	raw, err := hex.DecodeString(a)
	if err != nil {
		return netip.AddrPort{}, err
	}
	port, err := strconv.ParseUint(p, 16, 16)
	if err != nil {
		return netip.AddrPort{}, err
	}
	ip := make([]byte, len(raw))
	for i := 0; i < len(raw); i += 4 {
		binary.BigEndian.PutUint32(ip[i:], binary.LittleEndian.Uint32(raw[i:]))
	}
	addr, _ := netip.AddrFromSlice(ip)
	return netip.AddrPortFrom(addr.Unmap(), uint16(port)), nil
}

// socketsOf lists the sockets of pid's namespace from local to remote
// that are not in TIME_WAIT (which holds no data to deliver).
func socketsOf(t *testing.T, pid string, local, remote netip.AddrPort) []tcpConn {
	t.Helper()
	all, err := tcpSocketsOf(pid)
	if err != nil {
		t.Fatal(err)
	}
	var out []tcpConn
	for _, c := range all {
		if c.local == local && c.remote == remote && c.state != "06" {
			out = append(out, c)
		}
	}
	return out
}

// pid is the running server's process id ("" while it is down).
func (s *ourServer) pid() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.cmd == nil {
		return ""
	}
	return strconv.Itoa(s.cmd.Process.Pid)
}

// endTracker watches both ends of one TCP connection, each in its own
// network namespace, and notes when each is gone (closed, or in
// TIME_WAIT, which holds no data to deliver).
type endTracker struct {
	start                  time.Time
	mu                     sync.Mutex
	clientGone, serverGone time.Duration // since start; zero while open
	stop, done             chan struct{}
}

// trackEnds starts watching c (from this process's namespace) and its
// server's end (in the namespace of process spid).
func trackEnds(t *testing.T, c tcpConn, spid string) *endTracker {
	e := &endTracker{start: time.Now(), stop: make(chan struct{}), done: make(chan struct{})}
	open := func(pid string, local, remote netip.AddrPort) bool {
		all, err := tcpSocketsOf(pid)
		if err != nil {
			return true // cannot tell: count it open
		}
		for _, s := range all {
			if s.local == local && s.remote == remote && s.state != "06" {
				return true
			}
		}
		return false
	}
	go func() {
		defer close(e.done)
		for {
			cg := open("self", c.local, c.remote)
			sg := open(spid, c.remote, c.local)
			e.mu.Lock()
			if !cg && e.clientGone == 0 {
				e.clientGone = time.Since(e.start)
			}
			if !sg && e.serverGone == 0 {
				e.serverGone = time.Since(e.start)
			}
			both := e.clientGone != 0 && e.serverGone != 0
			e.mu.Unlock()
			if both {
				return
			}
			select {
			case <-e.stop:
				return
			case <-time.After(100 * time.Millisecond):
			}
		}
	}()
	t.Cleanup(e.end)
	return e
}

func (e *endTracker) end() {
	select {
	case <-e.stop:
	default:
		close(e.stop)
	}
	<-e.done
}

// wait waits until both ends are gone or deadline passes, and returns
// when each went (zero: still open).
func (e *endTracker) wait(deadline time.Time) (client, server time.Duration) {
	select {
	case <-e.done:
	case <-time.After(time.Until(deadline)):
		e.end()
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.clientGone, e.serverGone
}

// readImage reads the part of a server's file that fio writes.
func readImage(path string) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	b := make([]byte, fioSize)
	if _, err := f.ReadAt(b, 0); err != nil {
		return nil, err
	}
	return b, nil
}

func TestProcAddr(t *testing.T) {
	for in, want := range map[string]string{
		"0100007F:1F90":                         "127.0.0.1:8080",
		"0A014D0A:2A3A":                         "10.77.1.10:10810",
		"0000000000000000FFFF00000A014D0A:2A3A": "10.77.1.10:10810",
		"B80D0120000000000000000001000000:0050": "[2001:db8::1]:80",
	} {
		got, err := procAddr(in)
		if err != nil || got.String() != want {
			t.Errorf("procAddr(%q) = %v, %v; want %s", in, got, err, want)
		}
	}
	for _, bad := range []string{"", "0100007F", "01007F:1F90", "ZZ00007F:1F90", "0100007F:XYZ"} {
		if _, err := procAddr(bad); err == nil {
			t.Errorf("procAddr(%q): no error", bad)
		}
	}
}
