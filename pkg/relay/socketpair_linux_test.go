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

package relay

import (
	"bytes"
	"io"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

func TestNewSocketPair(t *testing.T) {
	kf, relayEnd, err := NewSocketPair()
	if err != nil {
		t.Fatal(err)
	}
	defer relayEnd.Close()
	defer kf.Close()

	flags, err := unix.FcntlInt(kf.Fd(), unix.F_GETFD, 0)
	if err != nil || flags&unix.FD_CLOEXEC == 0 {
		t.Fatalf("kernel end: FD_CLOEXEC not set (flags %#x, %v)", flags, err)
	}
	typ, err := unix.GetsockoptInt(int(kf.Fd()), unix.SOL_SOCKET, unix.SO_TYPE)
	if err != nil || typ != unix.SOCK_STREAM {
		t.Fatalf("socket type %d, %v; want SOCK_STREAM", typ, err)
	}
	dom, err := unix.GetsockoptInt(int(kf.Fd()), unix.SOL_SOCKET, unix.SO_DOMAIN)
	if err != nil || dom != unix.AF_UNIX {
		t.Fatalf("socket domain %d, %v; want AF_UNIX", dom, err)
	}
	if sb, err := unix.GetsockoptInt(int(kf.Fd()), unix.SOL_SOCKET, unix.SO_SNDBUF); err != nil || sb < 1<<20 {
		// Only a speed matter, and capped by net.core.wmem_max without
		// CAP_NET_ADMIN.
		t.Logf("kernel end SO_SNDBUF = %d (%v)", sb, err)
	}
	if _, ok := relayEnd.(*net.UnixConn); !ok {
		t.Fatalf("relay end is %T", relayEnd)
	}
	if _, err := kf.Write([]byte("ping")); err != nil {
		t.Fatal(err)
	}
	b := make([]byte, 4)
	if _, err := io.ReadFull(relayEnd, b); err != nil || !bytes.Equal(b, []byte("ping")) {
		t.Fatalf("read %q, %v", b, err)
	}
}

// GuardAgainstReclaim changes the whole process (mlockall, OOM score), so
// it runs in a child process.
func TestGuardAgainstReclaim(t *testing.T) {
	if os.Getenv("RELAY_GUARD_CHILD") == "1" {
		err := GuardAgainstReclaim()
		status, _ := os.ReadFile("/proc/self/status")
		adj, _ := os.ReadFile("/proc/self/oom_score_adj")
		flusher, ferr := unix.PrctlRetInt(unix.PR_GET_IO_FLUSHER, 0, 0, 0, 0)
		var locked, rss string
		for _, l := range strings.Split(string(status), "\n") {
			if strings.HasPrefix(l, "VmLck:") {
				locked = strings.Join(strings.Fields(l)[1:], " ")
			}
			if strings.HasPrefix(l, "VmRSS:") {
				rss = strings.Join(strings.Fields(l)[1:], " ")
			}
		}
		os.Stdout.WriteString("guard-error: " + errString(err) + "\n")
		os.Stdout.WriteString("VmLck: " + locked + "\n")
		os.Stdout.WriteString("VmRSS: " + rss + "\n")
		os.Stdout.WriteString("oom_score_adj: " + strings.TrimSpace(string(adj)) + "\n")
		if ferr == nil && flusher == 1 {
			os.Stdout.WriteString("io_flusher: 1\n")
		} else {
			os.Stdout.WriteString("io_flusher: 0\n")
		}
		os.Exit(0)
	}
	cmd := exec.Command(os.Args[0], "-test.run=^TestGuardAgainstReclaim$")
	cmd.Env = append(os.Environ(), "RELAY_GUARD_CHILD=1")
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("child: %v\n%s", err, out)
	}
	t.Logf("child:\n%s", out)
	s := string(out)
	if !strings.Contains(s, "guard-error: ") {
		t.Fatalf("child output:\n%s", s)
	}
	// Each step either worked or is reported: nothing is silently skipped.
	check := func(step, done, failed string) {
		t.Helper()
		if !strings.Contains(s, done) && !strings.Contains(s, failed) {
			t.Errorf("%s neither done nor reported:\n%s", step, s)
		}
	}
	check("mlockall", "VmLck: ", "mlockall:")
	if strings.Contains(s, "VmLck: 0 kB") && !strings.Contains(s, "mlockall:") {
		t.Error("mlockall reported success but locked nothing")
	}
	check("PR_SET_IO_FLUSHER", "io_flusher: 1", "prctl(PR_SET_IO_FLUSHER)")
	check("oom_score_adj", "oom_score_adj: -1000", "oom_score_adj -1000:")
	// With CAP_SYS_RESOURCE (and CAP_IPC_LOCK) every step must work.
	if hasCap(unix.CAP_SYS_RESOURCE) && hasCap(unix.CAP_IPC_LOCK) {
		for _, want := range []string{"oom_score_adj: -1000", "io_flusher: 1"} {
			if !strings.Contains(s, want) {
				t.Errorf("child output lacks %q", want)
			}
		}
		if strings.Contains(s, "mlockall:") {
			t.Errorf("mlockall failed with CAP_IPC_LOCK:\n%s", s)
		}
	} else {
		t.Log("no CAP_SYS_RESOURCE/CAP_IPC_LOCK here: failures above are expected and reported")
	}
}

// hasCap reports whether the effective capability set holds c.
func hasCap(c int) bool {
	status, err := os.ReadFile("/proc/self/status")
	if err != nil {
		return false
	}
	for _, l := range strings.Split(string(status), "\n") {
		if v, ok := strings.CutPrefix(l, "CapEff:"); ok {
			n, err := strconv.ParseUint(strings.TrimSpace(v), 16, 64)
			return err == nil && n&(1<<uint(c)) != 0
		}
	}
	return false
}

func errString(err error) string {
	if err == nil {
		return "<nil>"
	}
	return strings.ReplaceAll(err.Error(), "\n", "; ")
}
