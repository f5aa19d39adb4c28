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

package vm

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// TestVMSmoke boots the VM and runs the guest smoke test in it: the nbd
// driver and netlink family, MPTCP, mkfs.ext4, netns with veth and tbf.
func TestVMSmoke(t *testing.T) {
	cfg := Default(t)
	start := time.Now()
	res := RunGoTestWith(t, cfg, "./internal/testenv/vm/guest", "^TestGuestNBDDevice$")
	if !strings.Contains(res.Output, "--- PASS: TestGuestNBDDevice") {
		t.Errorf("guest output lacks the PASS line of TestGuestNBDDevice")
	}
	t.Logf("smoke test took %v in all, VM %v", time.Since(start).Round(time.Millisecond), res.Duration.Round(time.Millisecond))
}

// errorRecorder captures Errorf so that a test can check that a helper
// reports a failure.
type errorRecorder struct {
	testing.TB
	errs []string
}

func (r *errorRecorder) Errorf(format string, args ...any) {
	r.errs = append(r.errs, fmt.Sprintf(format, args...))
}

func TestVMGuestTestFailure(t *testing.T) {
	cfg := Default(t)
	rec := &errorRecorder{TB: t}
	// A 1ns test timeout (the last -test.timeout wins) makes the guest
	// test binary fail at once.
	res := runGoTest(rec, cfg, "./internal/testenv/vm/guest", "^TestGuestNBDDevice$", "-test.timeout=1ns")
	if len(rec.errs) != 1 || !strings.Contains(rec.errs[0], "payload exited with status 2") ||
		!strings.Contains(rec.errs[0], "test timed out") {
		t.Fatalf("errors reported: %q\nguest output:\n%s", rec.errs, res.Output)
	}
	if !strings.Contains(res.Output, "---- dmesg (tail) ----") {
		t.Errorf("no dmesg tail after a failed guest test:\n%s", res.Output)
	}
}

// privateTempDir points TMPDIR at a fresh directory so that the test can
// check Run leaves nothing behind.
func privateTempDir(t *testing.T) string {
	dir := t.TempDir()
	t.Setenv("TMPDIR", dir)
	return dir
}

func checkCleanedUp(t *testing.T, tmp string, res Result) {
	t.Helper()
	if ents, err := os.ReadDir(tmp); err != nil || len(ents) != 0 {
		t.Errorf("temporary directory not cleaned up: %v %v", ents, err)
	}
	if res.PID <= 0 {
		t.Fatalf("no qemu pid in result")
	}
	if b, err := os.ReadFile("/proc/" + strconv.Itoa(res.PID) + "/cmdline"); err == nil && strings.Contains(string(b), "qemu") {
		t.Errorf("qemu (pid %d) still running after Run returned", res.PID)
	}
}

func TestVMExitCode(t *testing.T) {
	cfg := Default(t)
	tmp := privateTempDir(t)
	cfg.Cmd = "echo payload-says-hello; echo \"env=$MPNBD_VM_TEST\"; exit 3"
	cfg.Env = map[string]string{"MPNBD_VM_TEST": "it's quoted"}
	res, err := Run(context.Background(), cfg)
	var ee *ExitError
	if !errors.As(err, &ee) || ee.Code != 3 {
		t.Fatalf("Run = %v, want *ExitError with code 3\n%s", err, res.Log)
	}
	if res.ExitCode != 3 {
		t.Errorf("ExitCode = %d, want 3", res.ExitCode)
	}
	if !strings.Contains(res.Output, "payload-says-hello") || !strings.Contains(res.Output, "env=it's quoted") {
		t.Errorf("payload output missing from Output:\n%s", res.Output)
	}
	if strings.Contains(res.Output, markerExit) || strings.Contains(res.Output, markerStart) {
		t.Errorf("Output includes init's markers:\n%s", res.Output)
	}
	t.Logf("VM ran %v", res.Duration.Round(time.Millisecond))
	checkCleanedUp(t, tmp, res)
}

func TestVMTimeout(t *testing.T) {
	cfg := Default(t)
	tmp := privateTempDir(t)
	cfg.Cmd = "echo sleeping; sleep 1000"
	cfg.Timeout = 5 * time.Second
	start := time.Now()
	res, err := Run(context.Background(), cfg)
	took := time.Since(start)
	if !errors.Is(err, ErrTimeout) || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Run = %v, want ErrTimeout and context.DeadlineExceeded\n%s", err, res.Log)
	}
	if res.ExitCode != -1 {
		t.Errorf("ExitCode = %d, want -1", res.ExitCode)
	}
	if took > cfg.Timeout+10*time.Second {
		t.Errorf("Run returned after %v, timeout %v", took, cfg.Timeout)
	}
	if !strings.Contains(res.Log, "sleeping") {
		t.Logf("the payload had not started when the timeout hit (slow boot)")
	}
	checkCleanedUp(t, tmp, res)
}

func TestVMSetupError(t *testing.T) {
	cfg := Default(t)
	bogus := t.TempDir() + "/bogus.ko"
	if err := os.WriteFile(bogus, []byte("not a module"), 0o644); err != nil {
		t.Fatal(err)
	}
	cfg.Modules = append(cfg.Modules, bogus)
	cfg.Files = nil
	cfg.Tools = nil
	res, err := Run(context.Background(), cfg)
	if err == nil || !strings.Contains(err.Error(), "guest setup failed: insmod") {
		t.Fatalf("Run = %v, want a setup error naming insmod\n%s", err, res.Log)
	}
}

// TestVMHostForward: the guest's connections to HostAddr reach a server on
// the host through Config.HostForwards, two at once, each its own
// connection; nothing else of the host answers.
func TestVMHostForward(t *testing.T) {
	cfg := DefaultUblk(t)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	nonce := strconv.FormatInt(time.Now().UnixNano(), 36)
	var conns atomic.Int32
	srv := &http.Server{
		Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			fmt.Fprintf(w, "%s served %s\n", nonce, r.URL.Path)
		}),
		ConnState: func(_ net.Conn, s http.ConnState) {
			if s == http.StateNew {
				conns.Add(1)
			}
		},
	}
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(func() { srv.Close() })
	cfg.HostForwards = []HostForward{{Port: 6443, To: ln.Addr().String()}}
	// A port not forwarded, and the host's own address on the host's
	// network, reach nothing.
	cfg.Cmd = fmt.Sprintf(`wget -q -O- http://%[1]s:6443/a & wget -q -O- http://%[1]s:6443/b & wait
wget -q -T 3 -O- http://%[1]s:6444/ && echo "unforwarded port answered"
wget -q -T 3 -O- http://10.0.2.2:%[2]d/ && echo "the host answered"
exit 0`, HostAddr, ln.Addr().(*net.TCPAddr).Port)
	res, err := Run(context.Background(), cfg)
	if err != nil {
		t.Fatalf("Run: %v\n%s", err, res.Log)
	}
	for _, want := range []string{nonce + " served /a", nonce + " served /b"} {
		if !strings.Contains(res.Output, want) {
			t.Errorf("guest output lacks %q:\n%s", want, res.Output)
		}
	}
	if strings.Contains(res.Output, "answered") {
		t.Errorf("the guest reached more than its forwards:\n%s", res.Output)
	}
	if n := conns.Load(); n != 2 {
		t.Errorf("the host server saw %d connections, want 2", n)
	}
	t.Logf("VM with host forwards ran %v", res.Duration.Round(time.Millisecond))
}
