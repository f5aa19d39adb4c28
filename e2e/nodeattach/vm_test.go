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
	"os"
	"os/exec"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/mpnbd/mpnbd/internal/testenv/vm"
)

// guestTests are the tests TestNodeAttachInVM runs inside the VM.
var guestTests = []string{"TestAttachTransports", "TestKernelTransportRefused", "TestServerRestartMidWrite",
	"TestPathDownMidRead", "TestWrongVolumeRefused", "TestReadoptAfterKill", "TestMeasureTransports",
	"TestNodeServiceKernelTransports", "TestTransportsServerKills", "TestTransportsLongOutage",
	"TestPluginRestartDuringOutage", "TestServerStallPastRequestTimeout", "TestReadoptHealthyDevices", "TestDatapathHandover", "TestDatapathHandoverDuringOutage"}

// soakGuestTests run in the VM only with MPNBD_SOAK=1 or when MPNBD_VM_RUN
// names them: TCG makes them too slow for every run.
var soakGuestTests = []string{"TestTransportsSilentStorage", "TestTransportsSilentPath"}

// TestNodeAttachInVM boots the test VM and runs this package's guest tests
// against the kernel's real nbd driver. MPNBD_VM_RUN, a regular
// expression, runs only the guest tests it matches.
func TestNodeAttachInVM(t *testing.T) {
	if os.Getenv("MPNBD_IN_VM") == "1" {
		t.Skip("already inside the VM")
	}
	all := guestTests
	if soak() || os.Getenv("MPNBD_VM_RUN") != "" {
		all = append(append([]string(nil), guestTests...), soakGuestTests...)
	}
	names := selectGuestTests(t, all)
	cfg := vm.Default(t)
	cfg.MemoryMB = 2048
	// The guest suite took 13-16 minutes on a loaded 2-core machine under TCG.
	cfg.Timeout = 22 * time.Minute
	addFaultTools(t, &cfg)
	runGuestTests(t, cfg, names)
}

// runGuestTests runs this package's guest tests names in the VM cfg
// describes and fails t for each that did not pass there.
func runGuestTests(t *testing.T, cfg vm.Config, names []string) vm.Result {
	t.Helper()
	res := vm.RunGoTestWith(t, cfg, "./e2e/nodeattach", "^("+strings.Join(names, "|")+")$")
	for _, name := range names {
		if !strings.Contains(res.Output, "--- PASS: "+name) {
			t.Errorf("%s did not pass in the VM; its own lines:\n%s", name, guestVerdict(res.Output, name))
		}
	}
	return res
}

// guestVerdict picks from a guest run's output the lines test name logged
// itself (not its child processes' logs), the last 25: they hold why it
// failed, which the whole console buries. A parallel test's lines come in
// blocks, each opened by go test's "=== CONT" or "=== NAME" line.
func guestVerdict(out, name string) string {
	if !strings.Contains(out, "=== RUN   "+name+"\n") {
		return "(it did not start)"
	}
	var own []string
	mine := false
	for _, line := range strings.Split(out, "\n") {
		l := strings.TrimSpace(line)
		if test, ok := testMarker(l); ok {
			mine = test == name || strings.HasPrefix(test, name+"/")
		} else if l == "PASS" || l == "FAIL" {
			mine = false
		}
		if !mine || strings.HasPrefix(l, "child:") || strings.Contains(l, "level=") {
			continue
		}
		own = append(own, line)
	}
	if len(own) > 25 {
		own = own[len(own)-25:]
	}
	return strings.Join(own, "\n")
}

// testMarker reports whether l is one of go test -v's lines that open a
// test's block of output, and the test it names.
func testMarker(l string) (string, bool) {
	for _, p := range []string{"=== RUN ", "=== PAUSE ", "=== CONT ", "=== NAME ", "--- PASS: ", "--- FAIL: ", "--- SKIP: "} {
		if rest, ok := strings.CutPrefix(l, p); ok {
			if f := strings.Fields(rest); len(f) > 0 {
				return f[0], true
			}
		}
	}
	return "", false
}

// selectGuestTests narrows names to those MPNBD_VM_RUN, a regular
// expression, matches (all when it is unset).
func selectGuestTests(t *testing.T, names []string) []string {
	t.Helper()
	re := os.Getenv("MPNBD_VM_RUN")
	if re == "" {
		return names
	}
	m, err := regexp.Compile(re)
	if err != nil {
		t.Fatalf("MPNBD_VM_RUN: %v", err)
	}
	var out []string
	for _, n := range names {
		if m.MatchString(n) {
			out = append(out, n)
		}
	}
	if len(out) == 0 {
		t.Skipf("MPNBD_VM_RUN=%q matches none of %v", re, names)
	}
	return out
}

// addFaultTools gives the guest what the fault tests run: fio, nft and
// Debian's nbd-server from the host (packages fio, nftables and
// nbd-server; without them
// those tests skip, saying so, and do not pass) and our own nbd-server,
// built for the guest. MPNBD_SOAK=1 goes through and lengthens the VM's
// time limit.
func addFaultTools(t *testing.T, cfg *vm.Config) {
	t.Helper()
	for _, tool := range []string{"fio", "nbd-server", "nft"} {
		if p, err := exec.LookPath(tool); err == nil {
			cfg.Tools = append(cfg.Tools, p)
		}
	}
	ours := vm.BuildGo(t, "./cmd/nbd-server")
	cfg.Tools = append(cfg.Tools, ours)
	if cfg.Env == nil {
		cfg.Env = map[string]string{}
	}
	cfg.Env[envOurServer] = ours
	if soak() {
		cfg.Env[envSoak] = "1"
		cfg.Timeout = 60 * time.Minute
	}
}

func TestGuestVerdict(t *testing.T) {
	out := strings.Join([]string{
		"    === RUN   TestA",
		"        child: x level=INFO msg=hello",
		"        a_test.go:10: step one",
		"        a_test.go:12: it broke",
		"    --- FAIL: TestA (1.00s)",
		"    === RUN   TestB",
		"        b_test.go:3: fine",
		"    === RUN   TestP",
		"    === PAUSE TestP",
		"    === RUN   TestD",
		"        d_test.go:1: other",
		"    --- PASS: TestD (1.00s)",
		"    === CONT  TestP",
		"    === RUN   TestP/tcp",
		"        p_test.go:7: timeout never fired",
		"    === NAME  TestB",
		"        b_test.go:4: still fine",
		"    --- FAIL: TestP (2.00s)",
		"        --- FAIL: TestP/tcp (2.00s)",
		"    FAIL",
		"    [  13.5] block nbd0: kernel line",
	}, "\n")
	got := guestVerdict(out, "TestA")
	for _, want := range []string{"step one", "it broke", "--- FAIL: TestA"} {
		if !strings.Contains(got, want) {
			t.Errorf("verdict of TestA lacks %q:\n%s", want, got)
		}
	}
	for _, not := range []string{"hello", "fine"} {
		if strings.Contains(got, not) {
			t.Errorf("verdict of TestA holds %q:\n%s", not, got)
		}
	}
	got = guestVerdict(out, "TestP")
	for _, want := range []string{"=== PAUSE TestP", "timeout never fired", "--- FAIL: TestP/tcp"} {
		if !strings.Contains(got, want) {
			t.Errorf("verdict of the parallel TestP lacks %q:\n%s", want, got)
		}
	}
	for _, not := range []string{"other", "still fine", "kernel line"} {
		if strings.Contains(got, not) {
			t.Errorf("verdict of the parallel TestP holds %q:\n%s", not, got)
		}
	}
	if got := guestVerdict(out, "TestC"); got != "(it did not start)" {
		t.Errorf("verdict of a test that never ran: %q", got)
	}
}
