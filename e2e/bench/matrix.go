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

// Package bench runs the side-by-side benchmark of NBD servers and
// clients over the multi-path topology of internal/testenv/topo (command
// e2e/cmd/bench) and contains the load generator of e2e/cmd/nbdload.
//
// One run is one (server, network, client, workload) combination for a
// fixed time. Every server exports a fresh 2 GiB file on tmpfs, allocated
// before the runs, so the backing store is never the bottleneck. Runs are repeated and
// the table shows medians; every repeat is kept in the JSON report.
package bench

import (
	"fmt"
	"slices"
	"strings"

	"github.com/mpnbd/mpnbd/internal/testenv/topo"
)

// Server names.
const (
	ServerOurs      = "ours"       // bin/nbd-server
	ServerOursB     = "ours-b"     // another build of nbd-server (Options.CandidateBin), measured beside ours
	ServerOursTLS   = "ours-tls"   // bin/nbd-server, TLS required (STARTTLS; our client negotiates 1.3); our client only
	ServerNbdkit    = "nbdkit"     // nbdkit's file plugin
	ServerNbdServer = "nbd-server" // Debian's nbd-server
)

// Client names.
const (
	ClientFio  = "fio"  // fio's nbd engine (libnbd)
	ClientOurs = "ours" // nbdload (pkg/nbd)
)

// AllServers, AllClients are the full matrix dimensions, in table order.
// ours-b is not part of "all": it is only there when named, to compare a
// change of the server with the build before it in the same run.
var (
	AllServers = []string{ServerOurs, ServerOursTLS, ServerNbdkit, ServerNbdServer}
	// serverOrder is the table order of every server name.
	serverOrder = []string{ServerOurs, ServerOursB, ServerOursTLS, ServerNbdkit, ServerNbdServer}
	AllClients  = []string{ClientFio, ClientOurs}
)

// Workload is one access pattern.
type Workload struct {
	Name       string `json:"name"`
	RW         string `json:"rw"` // fio --rw / nbdload --rw
	BlockSize  int    `json:"bs"`
	QueueDepth int    `json:"qd"`
}

// Write reports whether the workload writes (data flows to the server).
func (w Workload) Write() bool { return isWrite(w.RW) }

// AllWorkloads are the workloads of the full matrix, in table order.
var AllWorkloads = []Workload{
	{Name: "seqread", RW: "read", BlockSize: 1 << 20, QueueDepth: 8},
	{Name: "seqwrite", RW: "write", BlockSize: 1 << 20, QueueDepth: 8},
	{Name: "randread", RW: "randread", BlockSize: 4 << 10, QueueDepth: 32},
	{Name: "randwrite", RW: "randwrite", BlockSize: 4 << 10, QueueDepth: 32},
}

// Network is one way of connecting client and server.
type Network struct {
	Name string `json:"name"`
	// MPTCP: server and client use Multipath TCP (else plain TCP, which
	// stays on path 1).
	MPTCP bool   `json:"mptcp"`
	Desc  string `json:"desc"`
	// Topology names the kind of topology; networks with the same kind
	// (tcp1 and mptcp4) run on the same one, one after the other.
	Topology string `json:"topology"`
	// Config builds the topology for a topology name.
	Config func(name string) topo.Config `json:"-"`
	// AutoBackup runs the slow-path watch of the node plugin and the
	// storage agent (mptcp.SlowPaths) on both hosts: a path much slower
	// than the others is flagged backup by itself.
	AutoBackup bool `json:"auto_backup,omitempty"`
}

// autoSlowRatio is the fraction of the fastest path's rate under which
// the slow-path watch flags a path (mptcp.SlowPathPolicy's default).
const autoSlowRatio = 0.3

// LineRateMBps is the rate the network can carry, in MB/s (10^6 B/s):
// path 1 for plain TCP; for MPTCP the sum of all paths except those
// flagged backup (the scheduler only uses a backup subflow when no other
// subflow can send) and, with AutoBackup, those the slow-path watch flags.
func (n Network) LineRateMBps(t *topo.Topology) float64 {
	if !n.MPTCP {
		return float64(t.Paths[0].RateMbit) / 8
	}
	var sum float64
	for _, p := range t.Paths {
		autoFlagged := n.AutoBackup && slowForAuto(t, p.RateMbit)
		if !p.Backup && !autoFlagged {
			sum += float64(p.RateMbit) / 8
		}
	}
	return sum
}

// slowForAuto reports whether a path of rate is one the slow-path watch
// takes out of use on t.
func slowForAuto(t *topo.Topology, rate int) bool {
	fastest := 0
	for _, p := range t.Paths {
		fastest = max(fastest, p.RateMbit)
	}
	return float64(rate) < autoSlowRatio*float64(fastest)
}

// PlanLineRateMBps is LineRateMBps computed from the configuration alone.
func (n Network) PlanLineRateMBps() float64 {
	t, err := topo.Plan(n.Config("plan"))
	if err != nil {
		return 0
	}
	return n.LineRateMBps(t)
}

// AllNetworks are the networks of the full matrix, in table order.
var AllNetworks = []Network{
	{
		Name: "tcp1", Desc: "plain TCP over path 1 (1 Gbit/s)",
		Topology: "4x1G", Config: topo.Default4,
	},
	{
		Name: "mptcp4", MPTCP: true, Desc: "one MPTCP connection over 4 x 1 Gbit/s",
		Topology: "4x1G", Config: topo.Default4,
	},
	{
		Name: "asym", MPTCP: true, Desc: "one MPTCP connection over 3 x 1 Gbit/s + 1 x 100 Mbit/s",
		Topology: "3x1G+100M", Config: topo.Asymmetric,
	},
	{
		Name: "asym-backup", MPTCP: true, Desc: "as asym, the 100 Mbit/s path's server endpoint flagged backup",
		Topology: "3x1G+100M-backup",
		Config: func(name string) topo.Config {
			cfg := topo.Asymmetric(name)
			cfg.Paths[len(cfg.Paths)-1].Backup = true
			return cfg
		},
	},
	{
		Name: "asym-auto", MPTCP: true, AutoBackup: true,
		Desc:     "as asym, the slow-path watch on both hosts (as the node plugin and the storage agent run it)",
		Topology: "3x1G+100M", Config: topo.Asymmetric,
	},
}

// Matrix is a selection of every dimension.
type Matrix struct {
	Servers   []string
	Networks  []Network
	Clients   []string
	Workloads []Workload
}

// Size is the number of combinations (runs per repeat), those Pairs
// leaves out excluded.
func (m Matrix) Size() int {
	pairs := 0
	for _, s := range m.Servers {
		for _, c := range m.Clients {
			if Pairs(s, c) {
				pairs++
			}
		}
	}
	return pairs * len(m.Networks) * len(m.Workloads)
}

// Pairs reports whether client runs against server: fio's nbd engine
// cannot reach ours-tls (libnbd reads the certificates of an nbds:// URI
// only when the program allows it, and fio does not), so ours-tls is
// measured with our client only.
func Pairs(server, client string) bool {
	return server != ServerOursTLS || client != ClientFio
}

// ParseList splits a comma-separated selection and checks every element
// against valid ("all" or an empty string selects everything).
// Duplicates are dropped; the result keeps the order of valid.
func ParseList(s string, valid []string) ([]string, error) {
	s = strings.TrimSpace(s)
	if s == "" || s == "all" {
		return slices.Clone(valid), nil
	}
	want := map[string]bool{}
	for _, f := range strings.Split(s, ",") {
		f = strings.TrimSpace(f)
		if f == "" {
			continue
		}
		if !slices.Contains(valid, f) {
			return nil, fmt.Errorf("unknown %q (valid: %s)", f, strings.Join(valid, ", "))
		}
		want[f] = true
	}
	var out []string
	for _, v := range valid {
		if want[v] {
			out = append(out, v)
		}
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("empty selection %q", s)
	}
	return out, nil
}

// NewMatrix builds a matrix from comma-separated selections of server,
// network, client and workload names.
func NewMatrix(servers, networks, clients, workloads string) (Matrix, error) {
	var m Matrix
	var err error
	validServers := serverOrder
	if strings.TrimSpace(servers) == "" || strings.TrimSpace(servers) == "all" {
		validServers = AllServers
	}
	if m.Servers, err = ParseList(servers, validServers); err != nil {
		return m, fmt.Errorf("servers: %w", err)
	}
	if m.Clients, err = ParseList(clients, AllClients); err != nil {
		return m, fmt.Errorf("clients: %w", err)
	}
	var names []string
	for _, n := range AllNetworks {
		names = append(names, n.Name)
	}
	sel, err := ParseList(networks, names)
	if err != nil {
		return m, fmt.Errorf("networks: %w", err)
	}
	for _, n := range AllNetworks {
		if slices.Contains(sel, n.Name) {
			m.Networks = append(m.Networks, n)
		}
	}
	names = names[:0]
	for _, w := range AllWorkloads {
		names = append(names, w.Name)
	}
	if sel, err = ParseList(workloads, names); err != nil {
		return m, fmt.Errorf("workloads: %w", err)
	}
	for _, w := range AllWorkloads {
		if slices.Contains(sel, w.Name) {
			m.Workloads = append(m.Workloads, w)
		}
	}
	return m, nil
}

// NetworkByName returns the network called name.
func NetworkByName(name string) (Network, bool) {
	for _, n := range AllNetworks {
		if n.Name == name {
			return n, true
		}
	}
	return Network{}, false
}
