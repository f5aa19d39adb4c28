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
	"bufio"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/mpnbd/mpnbd/internal/testenv/repo"
)

// envMPTCPRequire, together with MPNBD_VM_REQUIRE, makes DefaultMPTCP
// fail instead of skip when the MPTCP kernel is not built.
const envMPTCPRequire = "MPNBD_VM_MPTCP_REQUIRE"

// mptcpKernelArgs set, on the kernel command line, the parameters Default
// gives the modules; the MPTCP kernel has them built in.
const mptcpKernelArgs = "nbd.nbds_max=8 brd.rd_nr=1 brd.rd_size=131072 loop.max_loop=4"

// ErrMPTCPKernelNotBuilt is returned by LoadMPTCPKernel when the cache
// holds no image for the current source, configuration and change.
var ErrMPTCPKernelNotBuilt = errors.New("vm: the MPTCP kernel is not built")

var (
	mptcpOnce   sync.Once
	mptcpKernel string
	mptcpErr    error
)

// LoadMPTCPKernel returns the path of the bzImage hack/vm-kernel-mptcp.sh
// built, whose nbd driver accepts MPTCP sockets. It never builds (a cold
// build takes ~20 minutes): without a cached image it returns an error
// wrapping ErrMPTCPKernelNotBuilt.
func LoadMPTCPKernel() (string, error) {
	mptcpOnce.Do(func() {
		mptcpKernel, mptcpErr = loadMPTCPKernel()
	})
	return mptcpKernel, mptcpErr
}

func loadMPTCPKernel() (string, error) {
	root, err := repo.Root()
	if err != nil {
		return "", err
	}
	script := filepath.Join(root, "hack", "vm-kernel-mptcp.sh")
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, "bash", script)
	cmd.Env = append(os.Environ(), "MPNBD_VM_NO_BUILD=1")
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	msg := strings.TrimSpace(stderr.String())
	var exit *exec.ExitError
	if errors.As(err, &exit) && exit.ExitCode() == 3 {
		return "", fmt.Errorf("%w: %s", ErrMPTCPKernelNotBuilt, msg)
	}
	if err != nil {
		return "", fmt.Errorf("%s: %v: %s", script, err, msg)
	}
	sc := bufio.NewScanner(strings.NewReader(string(out)))
	for sc.Scan() {
		if p, ok := strings.CutPrefix(sc.Text(), "VM_KERNEL_MPTCP="); ok && fileExists(p) {
			return p, nil
		}
	}
	return "", fmt.Errorf("%s printed no kernel: %s", script, msg)
}

// DefaultMPTCP is Default with the kernel hack/vm-kernel-mptcp.sh builds
// (Debian's 6.1 source, nbd accepting MPTCP sockets, everything built in,
// no modules) instead of the stock Debian one. When that kernel is not
// built it skips the test with the reason; it fails instead only when both
// MPNBD_VM_REQUIRE and MPNBD_VM_MPTCP_REQUIRE=1 are set, since building it
// is a separate, slow step.
func DefaultMPTCP(t testing.TB) Config {
	t.Helper()
	checkHost(t)
	k, err := LoadMPTCPKernel()
	if err != nil {
		msg := fmt.Sprintf("vm: no MPTCP guest kernel: %v", err)
		if os.Getenv(envRequire) == "1" && os.Getenv(envMPTCPRequire) == "1" {
			t.Fatalf("%s (%s and %s=1 are set)", msg, envRequire, envMPTCPRequire)
		}
		t.Skip(msg)
	}
	cfg := baseConfig(t, k)
	cfg.KernelArgs = mptcpKernelArgs
	return cfg
}
