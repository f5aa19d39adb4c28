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
	"fmt"
	"io"
	"math"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"
)

// listColumns are the columns of `mpnbdctl volumes`: one row per volume
// and node it is published to.
var listColumns = []string{
	"VOLUME", "PVC", "STORAGE-NODE", "SIZE", "PHASE", "NODE", "METRICS", "TRANSPORT",
	"CONNECTED", "MPTCP", "SUBFLOWS", "RECONNECTS", "OUTAGE", "HEALTH", "LAST-FAULT",
}

// pubColumns are the per-node columns of `mpnbdctl volume NAME`.
var pubColumns = []string{
	"NODE", "METRICS", "TRANSPORT", "CONNECTED", "MPTCP", "SUBFLOWS", "RECONNECTS", "OUTAGE",
	"REPLAYED", "RESENT", "RETAINED", "HEALTH",
}

// noPathsNote says why no bytes per path show.
const noPathsNote = "Bytes per path: none reported; the node plugin reads them from the kernel's MPTCP subflows (Linux 5.16+), on MPTCP connections only."

// pathColumns are the columns of the paths of `mpnbdctl volume NAME`.
var pathColumns = []string{"NODE", "CONNECTION", "LOCAL", "REMOTE", "SENT", "RECEIVED", "RETRANSMITTED", "RTT", "RATE"}

func writeJSON(w io.Writer, rep any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(rep)
}

func newTabWriter(w io.Writer) *tabwriter.Writer {
	return tabwriter.NewWriter(w, 0, 8, 2, ' ', 0)
}

// row writes cells as one tab-separated line, "-" for an empty cell.
func row(w io.Writer, indent string, cells ...string) {
	out := make([]string, len(cells))
	for i, c := range cells {
		out[i] = c
		if c == "" {
			out[i] = "-"
		}
	}
	fmt.Fprintln(w, indent+strings.Join(out, "\t"))
}

// writeTable writes every volume, one row per node it is published to
// (one row for an unpublished volume), then notes on the metrics.
func writeTable(w io.Writer, rep *Report) error {
	if len(rep.Volumes) == 0 {
		if rep.filtered {
			fmt.Fprintln(w, "No NBDVolume matches the filters.")
		} else {
			fmt.Fprintln(w, "No NBDVolumes.")
		}
		return writeNotes(w, rep)
	}
	tw := newTabWriter(w)
	row(tw, "", listColumns...)
	for _, v := range rep.Volumes {
		head := []string{v.Name, v.PVC, v.StorageNode, formatBytes(v.SizeBytes), v.Phase}
		if len(v.Publications) == 0 {
			row(tw, "", append(head, "", "", "", "", "", "", "", "", v.Health, faultText(v.LastFault, ""))...)
			continue
		}
		for _, p := range v.Publications {
			cells := append(append([]string{}, head...), p.Node, p.Metrics)
			cells = append(cells, dataPathCells(p.DataPath)...)
			row(tw, "", append(cells, p.Health, faultText(v.LastFault, p.Node))...)
		}
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	return writeNotes(w, rep)
}

// dataPathCells are TRANSPORT CONNECTED MPTCP SUBFLOWS RECONNECTS OUTAGE.
func dataPathCells(dp *DataPath) []string {
	if dp == nil {
		return make([]string, 6)
	}
	return []string{dp.Transport, yesNo(dp.Connected), yesNo(dp.MPTCP), subflowsText(dp),
		strconv.FormatInt(dp.Reconnects, 10), outageText(dp.OutageSeconds)}
}

// faultText is a fault for the row of node: the volume's fault unless it
// belongs to another node.
func faultText(f *Fault, node string) string {
	if f == nil || (node != "" && f.Node != "" && f.Node != node) {
		return ""
	}
	if f.Node != "" && node == "" {
		return f.Node + ": " + f.Message
	}
	return f.Message
}

// subflowsText is each connection's subflows against the expected
// number: "2/4" for one connection, "4/4,3/4" for two, "2/?" when the
// expected number is unknown.
func subflowsText(dp *DataPath) string {
	want := "?"
	if dp.ExpectedSubflows != nil {
		want = strconv.Itoa(*dp.ExpectedSubflows)
	}
	var parts []string
	for _, c := range dp.Connections {
		parts = append(parts, fmt.Sprintf("%d/%s", c.Subflows, want))
	}
	return strings.Join(parts, ",")
}

func outageText(s float64) string {
	if s <= 0 {
		return ""
	}
	return (time.Duration(s * float64(time.Second))).Round(time.Second).String()
}

func yesNo(b bool) string {
	if b {
		return "yes"
	}
	return "no"
}

// writeNotes says which nodes' metrics are missing and why, and the
// warnings.
func writeNotes(w io.Writer, rep *Report) error {
	var notes []string
	throughAPI := false
	for _, n := range rep.Nodes {
		if n.Status == MetricsOK {
			continue
		}
		notes = append(notes, fmt.Sprintf("Node %s: metrics %s: %s", n.Node, n.Status, n.Error))
		if n.Pod != "" || n.Status == MetricsNoPod {
			throughAPI = true
		}
	}
	if throughAPI {
		notes = append(notes, "The node plugins' metrics are read through the API server's pod proxy (list on pods, get on pods/proxy); "+
			"--metrics-port PORT reads each node's InternalIP directly, --metrics-url NODE=URL one node's endpoint.")
	}
	return printNotes(w, notes, rep.Warnings)
}

// writeDetail writes one volume in detail.
func writeDetail(w io.Writer, rep *Report) error {
	for _, v := range rep.Volumes {
		tw := newTabWriter(w)
		kv := func(k, v string) {
			if v == "" {
				v = "-"
			}
			fmt.Fprintf(tw, "%s:\t%s\n", k, v)
		}
		kv("Volume", v.Name)
		kv("PV", v.PV)
		kv("Claim", v.PVC)
		storage := v.StorageNode
		if len(v.StorageAddresses) > 0 {
			storage += fmt.Sprintf(" (%s; port %d)", strings.Join(v.StorageAddresses, ", "), v.StoragePort)
		}
		kv("Storage node", storage)
		size := formatBytes(v.SizeBytes)
		if v.CapacityBytes > 0 && v.CapacityBytes != v.SizeBytes {
			size += " (capacity " + formatBytes(v.CapacityBytes) + ")"
		}
		kv("Size", size)
		kv("Access type", v.AccessType)
		kv("Transport requested", v.RequestedTransport)
		kv("Phase", v.Phase)
		kv("Health", v.Health)
		kv("Last fault", detailFault(v.LastFault))
		if err := tw.Flush(); err != nil {
			return err
		}

		if len(v.Conditions) > 0 {
			fmt.Fprintln(w, "\nConditions:")
			tw = newTabWriter(w)
			row(tw, "  ", "TYPE", "STATUS", "REASON", "SINCE", "MESSAGE")
			for _, c := range v.Conditions {
				row(tw, "  ", c.Type, string(c.Status), c.Reason, timeText(c.LastTransitionTime.Time), c.Message)
			}
			if err := tw.Flush(); err != nil {
				return err
			}
		}

		if r := v.Replication; r != nil {
			primary := r.Primary
			if primary == "" {
				primary = "none recorded yet"
			}
			fmt.Fprintf(w, "\nReplicas (primary %s, epoch %d, %d in sync):\n", primary, r.Epoch, len(r.InSync))
			tw = newTabWriter(w)
			row(tw, "  ", "NODE", "STATE", "LACKING", "REBUILD")
			for _, rs := range r.Replicas {
				lacking, rebuild := "-", "-"
				if rs.LackingBytes > 0 {
					lacking = formatBytes(rs.LackingBytes)
				}
				if rs.RebuildTotalBytes > 0 {
					rebuild = fmt.Sprintf("%s of %s", formatBytes(rs.RebuildCopiedBytes), formatBytes(rs.RebuildTotalBytes))
				}
				row(tw, "  ", rs.Node, rs.State, lacking, rebuild)
			}
			if err := tw.Flush(); err != nil {
				return err
			}
		}

		fmt.Fprintln(w, "\nPublished to:")
		if len(v.Publications) == 0 {
			fmt.Fprintln(w, "  no node")
		}
		tw = newTabWriter(w)
		if len(v.Publications) > 0 {
			row(tw, "  ", pubColumns...)
		}
		var conns, paths [][]string
		for _, p := range v.Publications {
			cells := append([]string{p.Node, p.Metrics}, dataPathCells(p.DataPath)...)
			if dp := p.DataPath; dp != nil {
				cells = append(cells, strconv.FormatInt(dp.ReplayedRequests, 10), strconv.FormatInt(dp.ResentWrites, 10),
					strconv.FormatInt(dp.RetainedWrites, 10))
				for _, c := range dp.Connections {
					want := ""
					if dp.ExpectedSubflows != nil {
						want = strconv.Itoa(*dp.ExpectedSubflows)
					}
					conns = append(conns, []string{p.Node, strconv.Itoa(c.Index), strconv.Itoa(c.Subflows), want})
					for _, pa := range c.Paths {
						rtt, rate := "-", "-"
						if pa.RTTSeconds > 0 {
							rtt = time.Duration(pa.RTTSeconds * float64(time.Second)).Round(10 * time.Microsecond).String()
							rate = counterBytes(pa.DeliveryRate) + "/s"
						}
						paths = append(paths, []string{p.Node, strconv.Itoa(c.Index), pa.Local, pa.Remote,
							counterBytes(pa.SentBytes), counterBytes(pa.ReceivedBytes), counterBytes(pa.RetransBytes), rtt, rate})
					}
				}
			} else {
				cells = append(cells, "", "", "")
			}
			row(tw, "  ", append(cells, p.Health)...)
		}
		if err := tw.Flush(); err != nil {
			return err
		}

		if len(conns) > 0 {
			fmt.Fprintln(w, "\nConnections:")
			tw = newTabWriter(w)
			row(tw, "  ", "NODE", "CONNECTION", "SUBFLOWS", "EXPECTED")
			for _, c := range conns {
				row(tw, "  ", c...)
			}
			if err := tw.Flush(); err != nil {
				return err
			}
		}
		if len(paths) > 0 {
			fmt.Fprintln(w, "\nPaths (bytes since each subflow opened; round-trip time and delivery rate as the kernel last measured them):")
			tw = newTabWriter(w)
			row(tw, "  ", pathColumns...)
			for _, p := range paths {
				row(tw, "  ", p...)
			}
			if err := tw.Flush(); err != nil {
				return err
			}
		} else if len(conns) > 0 {
			fmt.Fprintln(w, noPathsNote)
		}
	}
	return writeNotes(w, rep)
}

// counterBytes is a byte counter in binary units ("1.5Gi").
func counterBytes(n uint64) string {
	return formatBytes(int64(min(n, math.MaxInt64)))
}

// detailFault is a fault with its node, source and time.
func detailFault(f *Fault) string {
	if f == nil {
		return "none seen"
	}
	s := f.Message
	if f.Node != "" {
		s = f.Node + ": " + s
	}
	where := f.Source
	if f.Source == FaultDataPath {
		where += ", now"
	}
	if f.Time != nil {
		where += ", " + timeText(*f.Time)
	}
	return s + " (" + where + ")"
}

func timeText(t time.Time) string {
	if t.IsZero() {
		return ""
	}
	return t.UTC().Format(time.RFC3339)
}

// printNotes writes the notes under a table, then the warnings, after a
// blank line; nothing when there are none.
func printNotes(w io.Writer, notes, warnings []string) error {
	for _, warn := range warnings {
		notes = append(notes, "Warning: "+warn)
	}
	if len(notes) == 0 {
		return nil
	}
	_, err := fmt.Fprintf(w, "\n%s\n", strings.Join(notes, "\n"))
	return err
}
