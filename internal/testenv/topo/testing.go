package topo

import (
	"os"
	"os/exec"
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
