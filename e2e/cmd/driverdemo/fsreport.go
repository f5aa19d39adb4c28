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
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"
	"syscall"
	"text/tabwriter"

	"github.com/mpnbd/mpnbd/e2e/bench"
)

// The columns of the --fio measurement: one path to the same storage
// node each, the raw NBD client first (the others' ratios are to it).
const (
	colRaw   = "raw"
	colBlock = "block"
	colExt4  = "ext4"
	colXFS   = "xfs"
)

// fsColumns are the columns in the order they are measured and shown.
var fsColumns = []string{colRaw, colBlock, colExt4, colXFS}

// FSBench is what --fio measured: rows of workloads, a result per
// column, side by side in one run on the same paths.
type FSBench struct {
	// Seconds is each run's measured time, after RampSeconds unmeasured.
	Seconds     float64 `json:"seconds"`
	RampSeconds float64 `json:"ramp_seconds"`
	VolumeBytes int64   `json:"volume_bytes"`
	// SpanBytes is the region every run uses: the raw client's and the
	// block device's first SpanBytes, the file's size on ext4 and xfs.
	SpanBytes int64 `json:"span_bytes"`
	// BackingDir holds the volumes' backing files; BackingFS is its
	// file system (tmpfs, ext4, ...).
	BackingDir string     `json:"backing_dir"`
	BackingFS  string     `json:"backing_fs"`
	Columns    []FSColumn `json:"columns"`
	Rows       []FSRow    `json:"rows"`
}

// FSColumn describes how one column reached the volume.
type FSColumn struct {
	Name string `json:"name"`
	What string `json:"what"`
	// Device is the block device the node made (not for raw); Queue
	// holds its settings from /sys/block/DEV/queue (and loop/dio).
	Device string            `json:"device,omitempty"`
	Queue  map[string]string `json:"queue,omitempty"`
	// MountOptions are those of the file system, as mounted.
	MountOptions string `json:"mount_options,omitempty"`
	// Subflows is the number of MPTCP subflows of the volume's
	// connection.
	Subflows int `json:"subflows"`
}

// FSRow is one workload.
type FSRow struct {
	Workload   string `json:"workload"`
	RW         string `json:"rw"`
	BlockSize  int64  `json:"bs"`
	QueueDepth int    `json:"qd"`
	Buffered   bool   `json:"buffered,omitempty"`
	// Baseline is the workload of the raw column that the row's ratios
	// are taken to (the row itself, or for buffered rows the direct
	// sequential one).
	Baseline string             `json:"baseline"`
	Results  map[string]*FSCell `json:"results"`
}

// FSCell is one measurement.
type FSCell struct {
	MBps    float64 `json:"mb_per_s"` // 10^6 bytes/s
	IOPS    float64 `json:"iops"`
	Seconds float64 `json:"seconds"`
	// Ratio is MBps over the raw column's MBps of the row's baseline.
	Ratio float64 `json:"ratio_to_raw,omitempty"`
	// Device is the block device the run went through; DeviceRequestKiB
	// is the mean size of the requests it completed during the run (ramp
	// included), DeviceFlushes the flushes it completed.
	Device           string  `json:"device,omitempty"`
	DeviceRequestKiB float64 `json:"device_request_kib,omitempty"`
	DeviceFlushes    uint64  `json:"device_flushes,omitempty"`
	// AgentRequestKiB is the mean size of the NBD requests the storage
	// agent got for the volume during the run, AgentFlushes its NBD
	// flushes.
	AgentRequestKiB float64 `json:"agent_request_kib"`
	AgentFlushes    uint64  `json:"agent_flushes"`
}

// String describes the result for the demo's progress lines.
func (c *FSCell) String() string {
	s := fmt.Sprintf("%.1f MB/s, %.0f IOPS; requests:", c.MBps, c.IOPS)
	if c.Device != "" {
		s += fmt.Sprintf(" %.0f KiB at %s (%d flushes),", c.DeviceRequestKiB, c.Device, c.DeviceFlushes)
	}
	return s + fmt.Sprintf(" %.0f KiB at the storage agent (%d flushes)", c.AgentRequestKiB, c.AgentFlushes)
}

// fsWorkload is one row's definition.
type fsWorkload struct {
	name     string
	rw       string // fio's and nbdload's --rw
	bs       int64
	qd       int
	buffered bool
	baseline string
}

// The workloads: direct I/O on every column, then what an application
// writing and reading a big file sees, on the file systems only.
var (
	directWorkloads = []fsWorkload{
		{name: "seqwrite", rw: "write", bs: 1 << 20, qd: 8},
		{name: "seqread", rw: "read", bs: 1 << 20, qd: 8},
		{name: "randwrite", rw: "randwrite", bs: 4 << 10, qd: 32},
		{name: "randread", rw: "randread", bs: 4 << 10, qd: 32},
	}
	bufferedWorkloads = []fsWorkload{
		{name: "buffered-write", rw: "write", bs: 1 << 20, qd: 1, buffered: true, baseline: "seqwrite"},
		{name: "buffered-read", rw: "read", bs: 1 << 20, qd: 1, buffered: true, baseline: "seqread"},
	}
)

// newFSBench makes the rows, without results.
func newFSBench() *FSBench {
	b := &FSBench{}
	for _, w := range append(append([]fsWorkload{}, directWorkloads...), bufferedWorkloads...) {
		base := w.baseline
		if base == "" {
			base = w.name
		}
		b.Rows = append(b.Rows, FSRow{Workload: w.name, RW: w.rw, BlockSize: w.bs, QueueDepth: w.qd,
			Buffered: w.buffered, Baseline: base, Results: map[string]*FSCell{}})
	}
	return b
}

// set records column col's result of workload.
func (b *FSBench) set(workload, col string, c *FSCell) {
	for i := range b.Rows {
		if b.Rows[i].Workload == workload {
			b.Rows[i].Results[col] = c
			return
		}
	}
}

// row returns the row of workload, or nil.
func (b *FSBench) row(workload string) *FSRow {
	for i := range b.Rows {
		if b.Rows[i].Workload == workload {
			return &b.Rows[i]
		}
	}
	return nil
}

// computeRatios sets every non-raw cell's ratio to the raw column's
// result of the row's baseline; a cell without a raw baseline gets none.
func (b *FSBench) computeRatios() {
	for i := range b.Rows {
		r := &b.Rows[i]
		var raw *FSCell
		if base := b.row(r.Baseline); base != nil {
			raw = base.Results[colRaw]
		}
		for col, c := range r.Results {
			c.Ratio = 0
			if col != colRaw && raw != nil && raw.MBps > 0 {
				c.Ratio = c.MBps / raw.MBps
			}
		}
	}
}

// label names a workload with its request size and queue depth.
func (w fsWorkload) label() string {
	if w.buffered {
		return fmt.Sprintf("%s %s (page cache)", w.name, formatBytes(w.bs))
	}
	return fmt.Sprintf("%s %s QD%d", w.name, formatBytes(w.bs), w.qd)
}

// label is a row's first column.
func (r *FSRow) label() string {
	return fsWorkload{name: r.Workload, bs: r.BlockSize, qd: r.QueueDepth, buffered: r.Buffered}.label()
}

// cellText formats a result: MB/s, IOPS for small requests, the ratio to
// raw.
func cellText(r *FSRow, c *FSCell) string {
	if c == nil {
		return "-"
	}
	s := fmt.Sprintf("%.1f", c.MBps)
	if c.MBps >= 100 {
		s = fmt.Sprintf("%.0f", c.MBps)
	}
	if r.BlockSize < 64<<10 {
		s += fmt.Sprintf(" / %.0f IOPS", c.IOPS)
	}
	if c.Ratio > 0 {
		s += fmt.Sprintf(" (%.2fx)", c.Ratio)
	}
	return s
}

// writeFSTable prints the measurement: a row per workload, a column per
// data path, MB/s (IOPS for 4 KiB) and the ratio to raw.
func writeFSTable(w io.Writer, b *FSBench) error {
	tw := tabwriter.NewWriter(w, 0, 0, 3, ' ', 0)
	fmt.Fprintf(tw, "  MB/s\t%s\n", strings.Join(fsColumns, "\t"))
	for i := range b.Rows {
		r := &b.Rows[i]
		cells := make([]string, len(fsColumns))
		for j, col := range fsColumns {
			cells[j] = cellText(r, r.Results[col])
		}
		fmt.Fprintf(tw, "  %s\t%s\n", r.label(), strings.Join(cells, "\t"))
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	_, err := fmt.Fprintf(w, "  (ratio to raw in parentheses; the page-cache rows' to raw %s and %s; %s per run after %s ramp, span %s, backing files on %s)\n",
		bufferedWorkloads[0].baseline, bufferedWorkloads[1].baseline,
		strconv.FormatFloat(b.Seconds, 'g', -1, 64)+"s", strconv.FormatFloat(b.RampSeconds, 'g', -1, 64)+"s",
		formatBytes(b.SpanBytes), b.BackingFS)
	return err
}

// fioCell turns fio's JSON report into a result. A job error, or a run
// that moved nothing, is an error.
func fioCell(out []byte) (*FSCell, error) {
	fr, err := bench.ParseFio(out)
	if err != nil {
		return nil, err
	}
	if fr.Error != 0 {
		return nil, fmt.Errorf("fio job error %d (%s)", fr.Error, syscall.Errno(fr.Error))
	}
	if fr.Bytes <= 0 || fr.Ops <= 0 || fr.Seconds <= 0 {
		return nil, errors.New("fio moved no data")
	}
	return &FSCell{MBps: fr.MBps, IOPS: fr.IOPS, Seconds: fr.Seconds}, nil
}

// nbdloadCell turns nbdload's JSON report into a result; subflows is the
// number of MPTCP subflows its connection had. A run that was not
// carried by MPTCP, had errors or moved nothing is an error.
func nbdloadCell(out []byte) (c *FSCell, subflows int, err error) {
	var lr bench.LoadReport
	if err := json.Unmarshal(out, &lr); err != nil {
		return nil, 0, fmt.Errorf("nbdload's report: %w", err)
	}
	if !lr.OK() {
		return nil, 0, errors.New(lr.Problem())
	}
	if len(lr.MPTCP) != 1 || !lr.MPTCP[0] || len(lr.Subflows) != 1 {
		return nil, 0, fmt.Errorf("the connection was not carried by MPTCP (mptcp %v, subflows %v)", lr.MPTCP, lr.Subflows)
	}
	return &FSCell{MBps: lr.MBps, IOPS: lr.IOPS, Seconds: lr.Seconds}, lr.Subflows[0], nil
}
