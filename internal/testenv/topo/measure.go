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

package topo

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/mpnbd/mpnbd/pkg/mptcp"
)

// Measurement is the result of MeasureTCP or MeasureMPTCP. It is meant
// to be printed, not asserted on: the numbers depend on the machine.
type Measurement struct {
	Kind     string        // "tcp" or "mptcp"
	Duration time.Duration // measured interval (after warm-up)
	// GoodputMBps is application payload received by the server, in
	// MB/s (10^6 bytes/s).
	GoodputMBps float64
	// LineRateMBps is the sum of the path rates in MB/s.
	LineRateMBps float64
	// PathTxMBps is, per path, the client veth's transmit byte counter
	// in MB/s. The counter sees GSO super-packets, so it holds the
	// payload plus one set of headers per super-packet: close to the
	// payload, below what tbf charges (tbf counts the headers of every
	// segment).
	PathTxMBps []float64
	// Subflows is the number of established subflows reported by
	// MPTCP_INFO on the client (initial + additional); 0 for "tcp".
	Subflows int
}

// String formats m for humans.
func (m Measurement) String() string {
	var b strings.Builder
	desc := fmt.Sprintf("%d parallel TCP streams (one per path)", len(m.PathTxMBps))
	if m.Kind == "mptcp" {
		desc = fmt.Sprintf("1 MPTCP connection, %d subflows", m.Subflows)
	}
	fmt.Fprintf(&b, "%s over %.1fs: goodput %.1f MB/s of %.1f MB/s line rate (%.1f%%)\n",
		desc, m.Duration.Seconds(), m.GoodputMBps, m.LineRateMBps, 100*m.GoodputMBps/m.LineRateMBps)
	for i, v := range m.PathTxMBps {
		fmt.Fprintf(&b, "  path %d: %.1f MB/s sent by the client veth\n", i+1, v)
	}
	return strings.TrimRight(b.String(), "\n")
}

// measureWarmup is skipped before measuring, to leave slow start and the
// MPTCP subflow setup out of the numbers.
const measureWarmup = time.Second

// MeasureTCP runs one plain TCP stream per path (client to server) for
// warm-up plus d and reports the achieved throughput.
func MeasureTCP(t *Topology, d time.Duration) (Measurement, error) {
	addrs := make([]netip.Addr, len(t.Paths))
	for i, p := range t.Paths {
		addrs[i] = p.ServerAddr
	}
	return measure(t, "tcp", addrs, d)
}

// MeasureMPTCP runs a single MPTCP connection from the client to the
// server address of path 1 for warm-up plus d and reports the achieved
// throughput and the per-path distribution of its subflows.
func MeasureMPTCP(t *Topology, d time.Duration) (Measurement, error) {
	return measure(t, "mptcp", []netip.Addr{t.ServerAddr(1)}, d)
}

func measure(t *Topology, kind string, targets []netip.Addr, d time.Duration) (m Measurement, err error) {
	useMPTCP := kind == "mptcp"
	m = Measurement{Kind: kind, LineRateMBps: t.LineRateMBps()}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()

	var (
		received atomic.Int64
		wg       sync.WaitGroup
		closers  []io.Closer
		mu       sync.Mutex
	)
	track := func(c io.Closer) {
		mu.Lock()
		closers = append(closers, c)
		mu.Unlock()
	}
	defer func() {
		cancel()
		mu.Lock()
		for _, c := range closers {
			c.Close()
		}
		mu.Unlock()
		wg.Wait()
	}()

	// Server side: one listener per target, each accepting one connection
	// and discarding (but counting) what it reads.
	lns := make([]net.Listener, len(targets))
	err = t.InServer(func() error {
		for i, a := range targets {
			ln, err := mptcp.Listen(ctx, "tcp4", netip.AddrPortFrom(a, 0).String(), useMPTCP)
			if err != nil {
				return err
			}
			track(ln)
			lns[i] = ln
		}
		return nil
	})
	if err != nil {
		return m, err
	}
	for _, ln := range lns {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c, err := ln.Accept()
			if err != nil {
				return
			}
			track(c)
			buf := make([]byte, 256<<10)
			for {
				n, err := c.Read(buf)
				received.Add(int64(n))
				if err != nil {
					return
				}
			}
		}()
	}

	// Client side: dial every listener and write until cancelled.
	conns := make([]net.Conn, len(lns))
	err = t.InClient(func() error {
		for i, ln := range lns {
			c, err := mptcp.Dialer(useMPTCP).DialContext(ctx, "tcp4", ln.Addr().String())
			if err != nil {
				return err
			}
			track(c)
			conns[i] = c
		}
		return nil
	})
	if err != nil {
		return m, err
	}
	if useMPTCP && !mptcp.IsMPTCP(conns[0]) {
		return m, errors.New("topo: measurement connection fell back to TCP")
	}
	for _, c := range conns {
		wg.Add(1)
		go func() {
			defer wg.Done()
			buf := make([]byte, 256<<10)
			for ctx.Err() == nil {
				if _, err := c.Write(buf); err != nil {
					return
				}
			}
		}()
	}

	time.Sleep(measureWarmup)
	tx0, err := t.clientTxBytes()
	if err != nil {
		return m, err
	}
	rx0, t0 := received.Load(), time.Now()
	time.Sleep(d)
	rx1, t1 := received.Load(), time.Now()
	tx1, err := t.clientTxBytes()
	if err != nil {
		return m, err
	}
	if useMPTCP {
		if info, err := mptcp.GetInfo(conns[0]); err == nil {
			m.Subflows = info.TotalSubflows()
		}
	}

	m.Duration = t1.Sub(t0)
	secs := m.Duration.Seconds()
	m.GoodputMBps = float64(rx1-rx0) / secs / 1e6
	m.PathTxMBps = make([]float64, len(t.Paths))
	for i := range t.Paths {
		m.PathTxMBps[i] = float64(tx1[i]-tx0[i]) / secs / 1e6
	}
	return m, nil
}

// clientTxBytes returns the transmitted byte counters of the client veth
// of each path.
func (t *Topology) clientTxBytes() ([]uint64, error) {
	out, err := output("ip", "-n", t.ClientNS, "-s", "-j", "link", "show")
	if err != nil {
		return nil, err
	}
	var links []struct {
		Ifname  string `json:"ifname"`
		Stats64 struct {
			Tx struct {
				Bytes uint64 `json:"bytes"`
			} `json:"tx"`
		} `json:"stats64"`
	}
	if err := json.Unmarshal([]byte(out), &links); err != nil {
		return nil, fmt.Errorf("topo: parsing ip -j link: %w", err)
	}
	byName := make(map[string]uint64, len(links))
	for _, l := range links {
		byName[l.Ifname] = l.Stats64.Tx.Bytes
	}
	tx := make([]uint64, len(t.Paths))
	for i, p := range t.Paths {
		v, ok := byName[p.ClientIf]
		if !ok {
			return nil, fmt.Errorf("topo: no statistics for %s in %s", p.ClientIf, t.ClientNS)
		}
		tx[i] = v
	}
	return tx, nil
}
