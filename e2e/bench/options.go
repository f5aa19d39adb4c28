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

package bench

import (
	"io"
	"os/exec"
	"time"
)

// Options configures Run.
type Options struct {
	Matrix   Matrix
	Duration time.Duration // measured time of every run
	Ramp     time.Duration // unmeasured warm-up before it
	Repeat   int

	ServerBin string // our nbd-server
	// CandidateBin is the nbd-server of server ours-b.
	CandidateBin string
	LoadBin      string // nbdload
	// TmpDir holds the sparse export files; it must be a tmpfs.
	TmpDir string
	// Name is the topology name (namespace/interface prefix, at most 11
	// characters). Leftovers of an earlier run with the same name are
	// removed first.
	Name string
	Port int // NBD port of the first server (the others take the next ones)
	// Sequential runs one server after the other on each network instead
	// of all of them side by side, each repeat taking every server in turn.
	Sequential bool

	// Progress receives one line per step; nil discards them.
	Progress io.Writer
	// OnRun, if set, is called after every run.
	OnRun func(RunResult)
}

func (o *Options) defaults() {
	if o.Duration <= 0 {
		o.Duration = 10 * time.Second
	}
	if o.Ramp < 0 {
		o.Ramp = 0
	}
	if o.Repeat <= 0 {
		o.Repeat = 1
	}
	if o.TmpDir == "" {
		o.TmpDir = "/dev/shm"
	}
	if o.Name == "" {
		o.Name = "mpbench"
	}
	if o.Port == 0 {
		o.Port = 10809
	}
	if o.Progress == nil {
		o.Progress = io.Discard
	}
}

// ourServer reports whether server is a build of our nbd-server (which
// opens MPTCP sockets itself).
func ourServer(server string) bool {
	return server == ServerOurs || server == ServerOursB || server == ServerOursTLS
}

// RequiredTools lists the external programs the matrix needs.
func RequiredTools(m Matrix) []string {
	tools := []string{"ip", "tc", "ss"}
	mptcpNet := false
	for _, n := range m.Networks {
		mptcpNet = mptcpNet || n.MPTCP
	}
	for _, s := range m.Servers {
		switch s {
		case ServerNbdkit:
			tools = append(tools, "nbdkit")
		case ServerNbdServer:
			tools = append(tools, "nbd-server")
		}
		if !ourServer(s) && mptcpNet {
			tools = append(tools, "mptcpize")
		}
	}
	for _, c := range m.Clients {
		if c == ClientFio {
			tools = append(tools, "fio")
			if mptcpNet {
				tools = append(tools, "mptcpize")
			}
		}
	}
	var out []string
	seen := map[string]bool{}
	for _, t := range tools {
		if !seen[t] {
			seen[t] = true
			out = append(out, t)
		}
	}
	return out
}

// MissingTools returns the required tools that are not on PATH.
func MissingTools(m Matrix) []string {
	var missing []string
	for _, t := range RequiredTools(m) {
		if _, err := exec.LookPath(t); err != nil {
			missing = append(missing, t)
		}
	}
	return missing
}
