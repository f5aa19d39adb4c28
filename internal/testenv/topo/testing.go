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

package topo

import (
	"os"
	"os/exec"
	"regexp"
	"strings"
	"testing"
)

// RequireRoot skips the test (printing the reason) unless the process
// runs as root and the iproute2 tools ip, tc and ss are installed.
func RequireRoot(t testing.TB) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skipf("skipping: needs root to create network namespaces (euid %d)", os.Geteuid())
	}
	for _, tool := range []string{"ip", "tc", "ss"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("skipping: %s (iproute2) not found: %v", tool, err)
		}
	}
}

// NewForTest builds cfg for a test: it skips unless RequireRoot passes,
// fails the test if Up fails and removes the topology when the test ends.
// An empty cfg.Name is replaced by a random unique name.
//
// Register cleanups that close sockets living in the namespaces after
// calling NewForTest, so they run before the namespaces are deleted.
func NewForTest(t testing.TB, cfg Config) *Topology {
	t.Helper()
	RequireRoot(t)
	if cfg.Name == "" {
		cfg.Name = UniqueName("mpt")
	}
	topo, err := Up(cfg)
	if err != nil {
		t.Fatalf("topology %q: %v", cfg.Name, err)
	}
	t.Cleanup(func() {
		if err := topo.Down(); err != nil {
			t.Errorf("topology %q teardown: %v", topo.Name, err)
		}
	})
	return topo
}

// envFreshNetns marks the child process InFreshNetns starts.
const envFreshNetns = "MPNBD_TOPO_FRESH_NETNS"

// InFreshNetns runs the calling top-level test again in a child process
// with a network namespace of its own (`unshare --net`) and reports
// whether this process is that child. The parent logs the child's
// output, fails if the child's test did not pass, and gets false: it
// returns at once. With a Config.ClientInCaller topology the child
// process is the client host, and everything it dials leaves from there.
func InFreshNetns(t *testing.T) bool {
	t.Helper()
	RequireRoot(t)
	if os.Getenv(envFreshNetns) == t.Name() {
		return true
	}
	if _, err := exec.LookPath("unshare"); err != nil {
		t.Skipf("skipping: unshare (util-linux) not found: %v", err)
	}
	cmd := exec.Command("unshare", "--net", "--", os.Args[0],
		"-test.run=^"+regexp.QuoteMeta(t.Name())+"$", "-test.v", "-test.count=1")
	cmd.Env = append(os.Environ(), envFreshNetns+"="+t.Name())
	out, err := cmd.CombinedOutput()
	t.Logf("in a network namespace of its own:\n%s", out)
	if err != nil || !strings.Contains(string(out), "--- PASS: "+t.Name()) {
		t.Fatalf("%s failed in its own network namespace: %v", t.Name(), err)
	}
	return false
}
