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
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/mpnbd/mpnbd/api/v1alpha1"
	"github.com/mpnbd/mpnbd/internal/testenv/apiserver"
	"github.com/mpnbd/mpnbd/internal/testenv/repo"
	"github.com/mpnbd/mpnbd/internal/testenv/topo"
	"github.com/mpnbd/mpnbd/pkg/mountinfo"
)

func TestParseSize(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want int64
	}{
		{"32MiB", 32 << 20}, {"32M", 32 << 20}, {"1GiB", 1 << 30}, {"1G", 1 << 30},
		{"4096", 4096}, {"10MB", 10_000_000}, {" 2 KiB ", 2048}, {"1TiB", 1 << 40},
	} {
		got, err := parseSize(tc.in)
		if err != nil || got != tc.want {
			t.Errorf("parseSize(%q) = %d, %v, want %d", tc.in, got, err, tc.want)
		}
	}
	for _, bad := range []string{"", "0", "-1MiB", "MiB", "12XB", "1.5GiB", "99999999999TiB"} {
		if got, err := parseSize(bad); err == nil {
			t.Errorf("parseSize(%q) = %d, want an error", bad, got)
		}
	}
}

func TestFormatBytes(t *testing.T) {
	for in, want := range map[int64]string{256 << 20: "256MiB", 1 << 30: "1GiB", 1536 << 20: "1536MiB", 1000: "1000B", 3 << 10: "3KiB"} {
		if got := formatBytes(in); got != want {
			t.Errorf("formatBytes(%d) = %q, want %q", in, got, want)
		}
	}
}

func TestParseArgs(t *testing.T) {
	var stderr bytes.Buffer
	o, err := parseArgs([]string{"--size", "32MiB", "--bin", "/x"}, &stderr)
	if err != nil {
		t.Fatal(err)
	}
	if o.fileSize != 32<<20 || o.volumeSize != 1<<30 || o.transport != "fuse" || o.binDir != "/x" ||
		!strings.HasPrefix(o.name, namePrefix) || o.out != filepath.Join("out", "driverdemo.json") {
		t.Errorf("options %+v", o)
	}
	for _, args := range [][]string{
		{"--size", "900MiB"}, // more than the volume can take
		{"--transport", "carrier-pigeon"},
		{"--fs", "btrfs"},
		{"--rate", "0"},
		{"extra"},
	} {
		if _, err := parseArgs(args, &stderr); err == nil {
			t.Errorf("%q: no error", args)
		}
	}
}

// ssOut is `ss -tniH state established` in a client namespace holding
// one MPTCP connection with 4 subflows and an unrelated one.
const ssOut = `0 0 10.77.3.1:48393 10.77.3.2:10900
	 bbr cwnd:276 bytes_sent:8594696 bytes_acked:8594697 bytes_received:8199944 tcp-ulp-mptcp flags:Jjec token:99850471(id:3)/45e98539(id:2) seq:95eb
0 0 10.77.1.1:32908 10.77.1.2:10809
	 bbr cwnd:10 bytes_sent:7801691 bytes_acked:7801692 bytes_received:11829389 tcp-ulp-mptcp flags:Mmec token:0000(id:0)/45e98539(id:0) seq:95eb
0 0 10.77.2.1:58997 10.77.2.2:10900
	 bbr bytes_sent:1 tcp-ulp-mptcp flags:Jjec token:99850471(id:2)/45e98539(id:3) seq:95eb
0 0 10.77.1.1:40000 10.77.1.2:9999
	 bbr bytes_sent:1 tcp-ulp-mptcp flags:Mmec token:0000(id:0)/11111111(id:0) seq:1
0 0 10.77.4.1:37767 10.77.4.2:10900
	 bbr bytes_sent:1 tcp-ulp-mptcp flags:Jjec token:99850471(id:4)/45e98539(id:1) seq:95eb
0 0 127.0.0.1:1 127.0.0.1:2
	 cubic cwnd:10
`

func TestConnectionSubflows(t *testing.T) {
	all, err := topo.ParseSubflows(ssOut)
	if err != nil {
		t.Fatal(err)
	}
	subs := connectionSubflows(all, netip.MustParseAddrPort("10.77.1.2:10809"))
	var got []string
	for _, s := range subs {
		got = append(got, s.Local.String())
	}
	want := "10.77.1.1:32908 10.77.2.1:58997 10.77.3.1:48393 10.77.4.1:37767"
	if strings.Join(got, " ") != want {
		t.Errorf("subflows from %v, want %s", got, want)
	}
	if subs := connectionSubflows(all, netip.MustParseAddrPort("10.77.1.2:1")); len(subs) != 0 {
		t.Errorf("subflows of a connection that does not exist: %v", subs)
	}

	tp, err := topo.Plan(topo.Default4("x"))
	if err != nil {
		t.Fatal(err)
	}
	var b bytes.Buffer
	if err := writeSubflowTable(&b, tp, subs); err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimSpace(b.String()), "\n")
	if len(lines) != 5 || !strings.Contains(lines[1], "initial") || !strings.Contains(lines[4], "10.77.4.2:10900") ||
		!strings.HasPrefix(strings.TrimSpace(lines[4]), "4 ") {
		t.Errorf("table:\n%s", b.String())
	}
}

func TestMPTCPLines(t *testing.T) {
	out := "tcp ESTAB 0 0 10.77.1.1:1 10.77.1.2:10809\n\t cubic tcp-ulp-mptcp flags:Mmec\n" +
		"mptcp ESTAB 0      0 10.77.1.1:1 10.77.1.2:10809\n\t subflows:3 add_addr_accepted:3\n"
	got := mptcpLines(out)
	want := []string{"mptcp ESTAB 0 0 10.77.1.1:1 10.77.1.2:10809", "subflows:3 add_addr_accepted:3"}
	if strings.Join(got, "|") != strings.Join(want, "|") {
		t.Errorf("got %q, want %q", got, want)
	}
}

func TestAge(t *testing.T) {
	for d, want := range map[time.Duration]string{3 * time.Second: "3s", 150 * time.Second: "2m30s", 20 * time.Minute: "20m", 5 * time.Hour: "5h"} {
		if got := age(d); got != want {
			t.Errorf("age(%s) = %q, want %q", d, got, want)
		}
	}
}

func TestVolumeTable(t *testing.T) {
	now := time.Now()
	v := &v1alpha1.NBDVolume{
		ObjectMeta: metav1.ObjectMeta{Name: "pvc-1", CreationTimestamp: metav1.NewTime(now.Add(-5 * time.Second))},
		Spec: v1alpha1.NBDVolumeSpec{SizeBytes: 1 << 30, StorageNode: "storage-1",
			Publications: []v1alpha1.Publication{{NodeID: "worker-1", SecretRef: "s"}}},
		Status: v1alpha1.NBDVolumeStatus{Phase: v1alpha1.VolumeAvailable,
			Export: &v1alpha1.Export{Name: "pvc-1", Port: 10809, Addresses: []string{"10.77.1.2", "10.77.2.2"}}},
	}
	var b bytes.Buffer
	if err := writeVolumeTable(&b, v, now); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"NAME", "PUBLISHED", "pvc-1", "storage-1", "1073741824", "Available", "worker-1", "5s", "10.77.2.2"} {
		if !strings.Contains(b.String(), want) {
			t.Errorf("table lacks %q:\n%s", want, b.String())
		}
	}
}

// requireDemo skips unless the demo can run here, and builds the
// driver's commands into a temporary directory.
func requireDemo(t *testing.T) string {
	t.Helper()
	if runtime.GOOS != "linux" || os.Geteuid() != 0 {
		t.Skip("the demo needs root on Linux (network namespaces, mounts, loop devices, FUSE)")
	}
	if _, err := os.Stat("/dev/fuse"); err != nil {
		t.Skipf("the demo uses the fuse transport: %v", err)
	}
	for _, tool := range []string{"nsenter", "ip", "tc", "ss", "losetup", "mkfs.ext4"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("the demo needs %s", tool)
		}
	}
	buildOnce.Do(func() {
		if buildDir, buildErr = os.MkdirTemp("", "driverdemo-test-bin-"); buildErr != nil {
			return
		}
		buildErr = repo.BuildCommands(buildDir)
	})
	if buildErr != nil {
		t.Fatal(buildErr)
	}
	return buildDir
}

// The driver's commands, built once for every test that runs the demo.
var (
	buildOnce sync.Once
	buildDir  string
	buildErr  error
)

func TestMain(m *testing.M) {
	code := m.Run()
	if buildDir != "" {
		os.RemoveAll(buildDir)
	}
	os.Exit(code)
}

// runDemo runs the demo in this process and returns its exit code, its
// output and its results.
func runDemo(t *testing.T, bin, name, work string, extra ...string) (int, string, *Result) {
	t.Helper()
	out := filepath.Join(t.TempDir(), "driverdemo.json")
	var stdout, stderr bytes.Buffer
	code := run(context.Background(), append([]string{"--bin", bin, "--size", "32MiB", "--name", name,
		"--work-dir", work, "--out", out}, extra...), &stdout, &stderr)
	output := stdout.String() + stderr.String()
	var r Result
	b, err := os.ReadFile(out)
	if err != nil {
		t.Fatalf("no results: %v\n%s", err, output)
	}
	if err := json.Unmarshal(b, &r); err != nil {
		t.Fatalf("results: %v\n%s", err, b)
	}
	if strings.Contains(r.Error, apiserver.ErrUnavailable.Error()) && os.Getenv(apiserver.RequireEnv) != "1" {
		t.Skipf("no API server on this machine: %s", r.Error)
	}
	return code, output, &r
}

// checkNothingLeft fails t when a namespace of topology name, a mount or
// loop device under work, or a process of a command in bin remains.
func checkNothingLeft(t *testing.T, bin, name, work string) {
	t.Helper()
	ents, err := os.ReadDir("/run/netns")
	if err != nil && !os.IsNotExist(err) {
		t.Fatal(err)
	}
	for _, e := range ents {
		if strings.HasPrefix(e.Name(), name) {
			t.Errorf("network namespace %s left", e.Name())
		}
	}
	m, err := mountinfo.Under(work)
	if err != nil {
		t.Fatal(err)
	}
	if len(m) > 0 {
		t.Errorf("mounts left: %v", m)
	}
	if l := loopsUnder(work); len(l) > 0 {
		t.Errorf("loop devices left: %v", l)
	}
	// The demo waits for the processes it started; the volume's FUSE
	// server exits with the detach. Give stragglers a generous moment.
	var procs []string
	waitErr := waitFor(context.Background(), "the driver's processes to exit", 20*time.Second, func() error {
		procs = procs[:0]
		exes, _ := filepath.Glob("/proc/[0-9]*/exe")
		for _, e := range exes {
			if target, err := os.Readlink(e); err == nil && strings.HasPrefix(target, bin+"/") {
				procs = append(procs, filepath.Dir(e)+" "+target)
			}
		}
		if len(procs) > 0 {
			return errors.New(strings.Join(procs, ", "))
		}
		return nil
	})
	if waitErr != nil {
		t.Errorf("processes left: %v", waitErr)
	}
	if ents, err := os.ReadDir(work); err == nil && len(ents) > 0 {
		t.Errorf("work directory %s not emptied: %d entries", work, len(ents))
	}
}

// TestDemo runs the whole demo with a small file: the volume must move
// the data intact over one MPTCP connection with a subflow on each of the
// 4 paths, and nothing may be left afterwards.
func TestDemo(t *testing.T) {
	bin := requireDemo(t)
	name := topo.UniqueName(namePrefix)
	work := filepath.Join(t.TempDir(), "work")
	code, output, r := runDemo(t, bin, name, work)
	t.Logf("demo output:\n%s", output)
	if code != 0 {
		t.Errorf("exit code %d, want 0", code)
	}
	if !r.OK || !r.ChecksumOK || r.Error != "" {
		t.Errorf("result ok=%t checksum_ok=%t error=%q", r.OK, r.ChecksumOK, r.Error)
	}
	if r.Subflows != 4 || r.StorageAddresses != 4 || !r.Healthy {
		t.Errorf("subflows %d of %d, healthy %t; want 4 of 4, healthy", r.Subflows, r.StorageAddresses, r.Healthy)
	}
	if r.FileBytes != 32<<20 || r.WriteMBps <= 0 || r.ReadMBps <= 0 || len(r.SHA256) != 64 {
		t.Errorf("measurements %+v", r)
	}
	checkNothingLeft(t, bin, name, work)
}

// TestDemoFailureCleansUp fails the demo once the file is written, with
// the volume staged and published, and checks that it says so and that
// the teardown still removes everything.
func TestDemoFailureCleansUp(t *testing.T) {
	bin := requireDemo(t)
	failpoint = func(step string) error {
		if strings.HasPrefix(step, "write ") {
			return errors.New("injected failure")
		}
		return nil
	}
	defer func() { failpoint = func(string) error { return nil } }()
	name := topo.UniqueName(namePrefix)
	work := filepath.Join(t.TempDir(), "work")
	code, output, r := runDemo(t, bin, name, work)
	if code != 1 {
		t.Errorf("exit code %d, want 1\n%s", code, output)
	}
	if r.OK || !strings.Contains(r.Error, "injected failure") {
		t.Errorf("result ok=%t error=%q, want the injected failure", r.OK, r.Error)
	}
	for _, want := range []string{"NodeUnpublishVolume", "NodeUnstageVolume", "DeleteVolume", "remove the network namespaces"} {
		if !strings.Contains(output, want) {
			t.Errorf("teardown did not run %q:\n%s", want, output)
		}
	}
	if strings.Contains(output, "leftovers removed") {
		t.Errorf("the orderly teardown left something for the sweep:\n%s", output)
	}
	checkNothingLeft(t, bin, name, work)
}
