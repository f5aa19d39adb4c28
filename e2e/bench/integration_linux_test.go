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

//go:build linux

package bench

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/mpnbd/mpnbd/internal/testenv/repo"
	"github.com/mpnbd/mpnbd/internal/testenv/topo"
	"github.com/mpnbd/mpnbd/pkg/mptcp"
)

// buildBinaries compiles our nbd-server and nbdload into a temporary
// directory.
func buildBinaries(t *testing.T) (server, load string) {
	t.Helper()
	goBin, err := exec.LookPath("go")
	if err != nil {
		t.Skipf("skipping: go not on PATH to build nbd-server and nbdload: %v", err)
	}
	root, err := repo.Root()
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	// Each in its own module: nbd-server in the driver's (whose go.sum
	// covers what it links), nbdload in this one.
	for _, b := range []struct{ dir, pkg string }{{root, "./cmd/nbd-server"}, {filepath.Join(root, "e2e"), "./cmd/nbdload"}} {
		cmd := exec.Command(goBin, "build", "-o", dir+"/", b.pkg)
		cmd.Dir = b.dir
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("go build %s: %v\n%s", b.pkg, err, out)
		}
	}
	return filepath.Join(dir, "nbd-server"), filepath.Join(dir, "nbdload")
}

// TestRunTinyMatrix runs ours and nbdkit, each with fio and nbdload, over
// the 4-path MPTCP network for 2 s, twice, and checks that every run
// succeeded with plausible numbers and that the servers took turns in
// each repeat. It asserts nothing about speed.
func TestRunTinyMatrix(t *testing.T) {
	topo.RequireRoot(t)
	if err := mptcp.Available(); err != nil {
		t.Skipf("skipping: %v", err)
	}
	m, err := NewMatrix("ours,nbdkit", "mptcp4", "fio,ours", "seqread")
	if err != nil {
		t.Fatal(err)
	}
	if missing := MissingTools(m); len(missing) > 0 {
		t.Skipf("skipping: missing tools %s (hack/install-deps.sh)", strings.Join(missing, ", "))
	}
	if ok, err := IsTmpfs("/dev/shm"); err != nil || !ok {
		t.Skipf("skipping: /dev/shm is not a tmpfs (%v)", err)
	}
	server, load := buildBinaries(t)
	name := topo.UniqueName("mpbt")
	var progress bytes.Buffer
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	rep, err := Run(ctx, Options{
		Matrix: m, Duration: 2 * time.Second, Ramp: 500 * time.Millisecond, Repeat: 2,
		ServerBin: server, LoadBin: load, TmpDir: "/dev/shm", Name: name, Port: 10809, Progress: &progress,
	})
	t.Logf("progress:\n%s", progress.String())
	if err != nil {
		t.Fatal(err)
	}
	var table bytes.Buffer
	if err := WriteTable(&table, rep.Cells); err != nil {
		t.Fatal(err)
	}
	t.Logf("table:\n%s", table.String())

	if len(rep.Runs) != 8 || len(rep.Cells) != 4 {
		t.Fatalf("%d runs, %d cells; want 8 and 4", len(rep.Runs), len(rep.Cells))
	}
	// Side by side: both servers run every first repeat before any second
	// one, each server's two clients one after the other.
	var order []string
	for _, r := range rep.Runs {
		order = append(order, fmt.Sprintf("%s/%s#%d", r.Server, r.Client, r.Repeat))
	}
	want := []string{"ours/fio#1", "ours/ours#1", "nbdkit/fio#1", "nbdkit/ours#1",
		"ours/fio#2", "ours/ours#2", "nbdkit/fio#2", "nbdkit/ours#2"}
	if !slices.Equal(order, want) {
		t.Errorf("runs in the order %v, want %v", order, want)
	}
	if strings.Contains(table.String(), "FAILED") {
		t.Fatal("a run failed")
	}
	for _, r := range rep.Runs {
		if !r.OK || r.MBps <= 0 || r.IOPS <= 0 || r.Bytes <= 0 || r.Seconds <= 0 {
			t.Errorf("%s: implausible %+v", r.Key, r)
		}
		if r.ServerCPUSeconds <= 0 || r.ServerCPUPerGB <= 0 || r.ClientCPUPerGB <= 0 || r.WireBytes < r.Bytes {
			t.Errorf("%s: CPU %.3f s (%.3f s/GB server, %.3f s/GB client), %d bytes on the wire for %d measured",
				r.Key, r.ServerCPUSeconds, r.ServerCPUPerGB, r.ClientCPUPerGB, r.WireBytes, r.Bytes)
		}
		if !r.MPTCP || r.Subflows == nil || r.Subflows.Total != 4 || r.Subflows.Active != 4 {
			t.Errorf("%s: MPTCP %v subflows %v, want 4 active", r.Key, r.MPTCP, r.Subflows)
		}
		if r.Client == ClientOurs && (len(r.ClientSubflows) != 1 || r.ClientSubflows[0] != 4) {
			t.Errorf("%s: nbdload saw subflows %v, want [4]", r.Key, r.ClientSubflows)
		}
	}
	for _, c := range rep.Cells {
		if c.LineMBps != 500 || c.PctLine <= 0 || c.VsNbdkit <= 0 {
			t.Errorf("cell %s: line %v, %% %v, vs nbdkit %v", c.Key, c.LineMBps, c.PctLine, c.VsNbdkit)
		}
		if c.Server == ServerOurs && (c.CPUPairs != 2 || c.CPUVsNbdkit <= 0) {
			t.Errorf("cell %s: server CPU paired with nbdkit's in %d repeats (ratio %v), want 2", c.Key, c.CPUPairs, c.CPUVsNbdkit)
		}
	}

	// Nothing is left behind.
	if _, err := os.Stat("/run/netns/" + topo.ClientNSName(name)); !os.IsNotExist(err) {
		t.Errorf("client namespace still exists (%v)", err)
	}
	leftovers, _ := filepath.Glob("/dev/shm/mpnbd-bench-" + name + "-*")
	if len(leftovers) > 0 {
		t.Errorf("export files left: %v", leftovers)
	}
	for _, p := range allProcs() {
		if p.Comm == "nbdkit" || p.Comm == "nbd-server" || p.Comm == "nbdload" || p.Comm == "fio" {
			if cmdline, _ := os.ReadFile(filepath.Join("/proc", strconv.Itoa(p.PID), "cmdline")); bytes.Contains(cmdline, []byte(name)) ||
				bytes.Contains(cmdline, []byte(server)) {
				t.Errorf("process left running: %d %s", p.PID, p.Comm)
			}
		}
	}
}
