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

package main

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/mpnbd/mpnbd/internal/testenv/topo"
	"github.com/mpnbd/mpnbd/pkg/nbdmetrics"
)

// ioCounts are cumulative request counters of a block device or of an
// export at the storage agent; the difference of two tells what a run
// sent.
type ioCounts struct {
	reads, readBytes, writes, writtenBytes, flushes uint64
}

// sub returns the counts from a to c.
func (c ioCounts) sub(a ioCounts) ioCounts {
	return ioCounts{c.reads - a.reads, c.readBytes - a.readBytes, c.writes - a.writes,
		c.writtenBytes - a.writtenBytes, c.flushes - a.flushes}
}

// meanRequestKiB is the mean size of the requests counted, in the
// direction that moved more data.
func (c ioCounts) meanRequestKiB() float64 {
	reqs, bytes := c.reads, c.readBytes
	if c.writtenBytes > bytes {
		reqs, bytes = c.writes, c.writtenBytes
	}
	if reqs == 0 {
		return 0
	}
	return float64(bytes) / 1024 / float64(reqs)
}

// parseDiskStat parses /sys/block/DEV/stat (Documentation/block/stat.rst:
// reads, merges, sectors, ticks, then the same for writes, in flight, io
// and queue ticks, the same four for discards, then flushes and their
// ticks; sectors are 512 bytes).
func parseDiskStat(s string) (ioCounts, error) {
	f := strings.Fields(s)
	if len(f) < 7 {
		return ioCounts{}, fmt.Errorf("block device stat %q: want at least 7 fields", s)
	}
	var n [16]uint64
	for _, i := range []int{0, 2, 4, 6, 15} {
		if i >= len(f) {
			continue // no flush counters before Linux 5.5
		}
		v, err := strconv.ParseUint(f[i], 10, 64)
		if err != nil {
			return ioCounts{}, fmt.Errorf("block device stat %q: %w", s, err)
		}
		n[i] = v
	}
	return ioCounts{reads: n[0], readBytes: n[2] * 512, writes: n[4], writtenBytes: n[6] * 512, flushes: n[15]}, nil
}

// deviceCounts reads the counters of block device dev (/dev/NAME).
func deviceCounts(dev string) (ioCounts, error) {
	b, err := os.ReadFile(filepath.Join("/sys/block", filepath.Base(dev), "stat"))
	if err != nil {
		return ioCounts{}, err
	}
	return parseDiskStat(string(b))
}

// agentMetricsAddr is where the storage agent serves its metrics in the
// server namespace, with --fio.
const agentMetricsAddr = "127.0.0.1:9109"

// The storage agent's metrics that parseAgentMetrics reads.
var (
	metricPrefix      = nbdmetrics.Namespace + "_" + nbdmetrics.Subsystem + "_"
	metricReadBytes   = metricPrefix + "read_bytes_total"
	metricWriteBytes  = metricPrefix + "written_bytes_total"
	metricRequests    = metricPrefix + "requests_total"
	requestsByCommand = map[string]func(*ioCounts) *uint64{
		"read":  func(c *ioCounts) *uint64 { return &c.reads },
		"write": func(c *ioCounts) *uint64 { return &c.writes },
		"flush": func(c *ioCounts) *uint64 { return &c.flushes },
	}
)

// parseAgentMetrics reads the counters of export from the storage agent's
// metrics (Prometheus text format).
func parseAgentMetrics(r io.Reader, export string) (ioCounts, error) {
	var c ioCounts
	found := false
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if line == "" || line[0] == '#' {
			continue
		}
		series, value, ok := strings.Cut(line, " ")
		if !ok {
			continue
		}
		name, labels, _ := strings.Cut(strings.TrimSuffix(series, "}"), "{")
		l := parseLabels(labels)
		if l["export"] != export {
			continue
		}
		var dst *uint64
		switch name {
		case metricReadBytes:
			dst = &c.readBytes
		case metricWriteBytes:
			dst = &c.writtenBytes
		case metricRequests:
			if f := requestsByCommand[l["cmd"]]; f != nil {
				dst = f(&c)
			}
		}
		if dst == nil {
			continue
		}
		v, err := strconv.ParseFloat(strings.Fields(value)[0], 64)
		if err != nil || v < 0 {
			return ioCounts{}, fmt.Errorf("metric %s: value %q", series, value)
		}
		*dst, found = uint64(v), true
	}
	if err := sc.Err(); err != nil {
		return ioCounts{}, err
	}
	if !found {
		return ioCounts{}, fmt.Errorf("no request counters of export %s in the storage agent's metrics", export)
	}
	return c, nil
}

// parseLabels parses the labels of a series (a="x",b="y"), whose values
// here hold neither quotes nor commas.
func parseLabels(s string) map[string]string {
	m := map[string]string{}
	for _, kv := range strings.Split(s, ",") {
		k, v, ok := strings.Cut(kv, "=")
		if ok {
			m[strings.TrimSpace(k)] = strings.Trim(v, `"`)
		}
	}
	return m
}

// agentCounts scrapes the storage agent's counters of export, dialling
// its metrics endpoint from inside the server namespace.
func (d *demo) agentCounts(ctx context.Context, export string) (ioCounts, error) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	tr := &http.Transport{DisableKeepAlives: true, DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
		var c net.Conn
		err := topo.InNetns(d.topo.ServerNS, func() error {
			var err error
			c, err = (&net.Dialer{}).DialContext(ctx, network, addr)
			return err
		})
		return c, err
	}}
	defer tr.CloseIdleConnections()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+agentMetricsAddr+"/metrics", nil)
	if err != nil {
		return ioCounts{}, err
	}
	resp, err := (&http.Client{Transport: tr}).Do(req)
	if err != nil {
		return ioCounts{}, fmt.Errorf("storage agent metrics: %w", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return ioCounts{}, fmt.Errorf("storage agent metrics: %s", resp.Status)
	}
	return parseAgentMetrics(resp.Body, export)
}
