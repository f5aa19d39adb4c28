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
	"net/netip"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"
	"unicode"

	"github.com/mpnbd/mpnbd/api/v1alpha1"
	"github.com/mpnbd/mpnbd/internal/testenv/topo"
)

// Result is what the demo measured; it is written to out/driverdemo.json.
type Result struct {
	OK bool `json:"ok"`
	// Error is the first failure, empty when OK.
	Error     string `json:"error,omitempty"`
	Transport string `json:"transport"`
	Paths     int    `json:"paths"`
	// LineMBps is the sum of the path rates in MB/s (10^6 bytes/s).
	LineMBps  float64 `json:"line_mb_per_s"`
	FileBytes int64   `json:"file_bytes"`
	WriteMBps float64 `json:"write_mb_per_s"`
	ReadMBps  float64 `json:"read_mb_per_s"`
	// Subflows is the number of MPTCP subflows of the volume's NBD
	// connection; StorageAddresses is how many it should have (one per
	// storage address).
	Subflows         int    `json:"subflows"`
	StorageAddresses int    `json:"storage_addresses"`
	Healthy          bool   `json:"healthy"`
	SHA256           string `json:"sha256,omitempty"`
	ChecksumOK       bool   `json:"checksum_ok"`
	Steps            []Step `json:"steps"`
	// FS is the --fio measurement: fio through the block device and
	// the file systems against the raw NBD client.
	FS *FSBench `json:"fs_bench,omitempty"`
}

// Step is one step of the demo and how long it took.
type Step struct {
	Name    string  `json:"name"`
	Seconds float64 `json:"seconds"`
	Error   string  `json:"error,omitempty"`
}

// parseSize parses a byte count with an optional binary (KiB, MiB, GiB,
// TiB; K, M, G, T mean the same) or decimal (kB, MB, GB, TB) unit.
func parseSize(s string) (int64, error) {
	s = strings.TrimSpace(s)
	i := strings.IndexFunc(s, func(r rune) bool { return !unicode.IsDigit(r) })
	num, unit := s, ""
	if i >= 0 {
		num, unit = s[:i], strings.TrimSpace(s[i:])
	}
	n, err := strconv.ParseInt(num, 10, 64)
	if err != nil || n <= 0 {
		return 0, fmt.Errorf("invalid size %q: want a positive number with an optional unit such as MiB or GiB", s)
	}
	mult := map[string]int64{
		"": 1, "B": 1,
		"K": 1 << 10, "KiB": 1 << 10, "M": 1 << 20, "MiB": 1 << 20,
		"G": 1 << 30, "GiB": 1 << 30, "T": 1 << 40, "TiB": 1 << 40,
		"kB": 1e3, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12,
	}[unit]
	if mult == 0 {
		return 0, fmt.Errorf("invalid size %q: unknown unit %q", s, unit)
	}
	if n > (1<<62)/mult {
		return 0, fmt.Errorf("invalid size %q: too large", s)
	}
	return n * mult, nil
}

// formatBytes prints n in the largest binary unit that divides it, for
// messages ("256MiB").
func formatBytes(n int64) string {
	for _, u := range []struct {
		name string
		size int64
	}{{"TiB", 1 << 40}, {"GiB", 1 << 30}, {"MiB", 1 << 20}, {"KiB", 1 << 10}} {
		if n >= u.size && n%u.size == 0 {
			return fmt.Sprintf("%d%s", n/u.size, u.name)
		}
	}
	return fmt.Sprintf("%dB", n)
}

// mbps is a throughput in MB/s (10^6 bytes/s).
func mbps(bytes int64, d time.Duration) float64 {
	if d <= 0 {
		return 0
	}
	return float64(bytes) / 1e6 / d.Seconds()
}

// connectionSubflows picks, from the subflows of a namespace, those of
// the MPTCP connection whose initial subflow goes to primary (the
// storage node's dialled address): the subflows share the initial
// subflow's token. They are sorted by local address.
func connectionSubflows(subs []topo.Subflow, primary netip.AddrPort) []topo.Subflow {
	var token uint32
	found := false
	for _, s := range subs {
		if s.Remote == primary && !s.Join() {
			token, found = s.Token, true
			break
		}
	}
	if !found {
		return nil
	}
	var out []topo.Subflow
	for _, s := range subs {
		if s.Token == token {
			out = append(out, s)
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Local.Compare(out[j].Local) < 0 })
	return out
}

// writeSubflowTable prints one line per subflow: path, local address,
// remote address, kind and bytes moved.
func writeSubflowTable(w io.Writer, t *topo.Topology, subs []topo.Subflow) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "     path\tlocal\t\tremote\tkind\tsent MB\treceived MB")
	for _, s := range subs {
		kind := "initial (MP_CAPABLE)"
		if s.Join() {
			kind = "joined (MP_JOIN)"
		}
		if s.Backup() {
			kind += ", backup"
		}
		path := "?"
		if t != nil {
			if p := t.PathOf(s.Remote.Addr()); p > 0 {
				path = strconv.Itoa(p)
			}
		}
		fmt.Fprintf(tw, "     %s\t%s\t->\t%s\t%s\t%.1f\t%.1f\n", path, s.Local, s.Remote, kind,
			float64(s.BytesSent)/1e6, float64(s.BytesReceived)/1e6)
	}
	return tw.Flush()
}

// writeVolumeTable prints an NBDVolume the way `kubectl get nbdvol -o
// wide` shows it (the CRD's printer columns), with its export below.
func writeVolumeTable(w io.Writer, v *v1alpha1.NBDVolume, now time.Time) error {
	tw := tabwriter.NewWriter(w, 0, 0, 3, ' ', 0)
	fmt.Fprintln(tw, "     NAME\tNODE\tSIZE\tPHASE\tPUBLISHED\tAGE")
	var nodes []string
	for _, p := range v.Spec.Publications {
		nodes = append(nodes, p.NodeID)
	}
	fmt.Fprintf(tw, "     %s\t%s\t%d\t%s\t%s\t%s\n", v.Name, v.Spec.StorageNode, v.Spec.SizeBytes,
		v.Status.Phase, strings.Join(nodes, " "), age(now.Sub(v.CreationTimestamp.Time)))
	if err := tw.Flush(); err != nil {
		return err
	}
	if e := v.Status.Export; e != nil {
		_, err := fmt.Fprintf(w, "     export %q on port %d at %s\n", e.Name, e.Port, strings.Join(e.Addresses, ", "))
		return err
	}
	return nil
}

// age formats a duration like kubectl's AGE column (the two largest
// units for short spans).
func age(d time.Duration) string {
	switch s := int(d.Seconds()); {
	case s < 0:
		return "0s"
	case s < 120:
		return fmt.Sprintf("%ds", s)
	case s < 600:
		if s%60 == 0 {
			return fmt.Sprintf("%dm", s/60)
		}
		return fmt.Sprintf("%dm%ds", s/60, s%60)
	case s < 3*3600:
		return fmt.Sprintf("%dm", s/60)
	default:
		return fmt.Sprintf("%dh", s/3600)
	}
}

// writeSummary prints the final table.
func writeSummary(w io.Writer, r *Result) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	check := "not verified"
	switch {
	case r.ChecksumOK:
		check = "OK"
	case r.ReadMBps > 0:
		check = "MISMATCH"
	}
	status := "OK"
	if !r.OK {
		status = "FAILED"
	}
	fmt.Fprintf(tw, "  transport\t%s, %d paths, line rate %.0f MB/s\n", r.Transport, r.Paths, r.LineMBps)
	fmt.Fprintf(tw, "  file\t%s\n", formatBytes(r.FileBytes))
	fmt.Fprintf(tw, "  write MB/s\t%.1f\n", r.WriteMBps)
	fmt.Fprintf(tw, "  read MB/s\t%.1f\n", r.ReadMBps)
	fmt.Fprintf(tw, "  subflows\t%d of %d\n", r.Subflows, r.StorageAddresses)
	fmt.Fprintf(tw, "  volume health\t%s\n", map[bool]string{true: "healthy", false: "NOT healthy"}[r.Healthy])
	fmt.Fprintf(tw, "  checksum\t%s\n", check)
	fmt.Fprintf(tw, "  result\t%s\n", status)
	return tw.Flush()
}

// writeJSON stores r at path, creating its directory.
func writeJSON(path string, r *Result) error {
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return err
	}
	b, err := json.MarshalIndent(r, "", "  ")
	if err != nil {
		return err
	}
	return os.WriteFile(path, append(b, '\n'), 0o644)
}
