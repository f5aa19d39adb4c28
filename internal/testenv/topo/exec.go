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
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
)

// run executes an iproute2 command and returns an error including its
// output when it fails.
func run(name string, args ...string) error {
	_, err := output(name, args...)
	return err
}

// output executes a command and returns its standard output.
func output(name string, args ...string) (string, error) {
	cmd := exec.Command(name, args...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout = &stdout
	cmd.Stderr = &stderr
	if err := cmd.Run(); err != nil {
		msg := strings.TrimSpace(stderr.String())
		if msg == "" {
			msg = strings.TrimSpace(stdout.String())
		}
		return stdout.String(), fmt.Errorf("topo: %s %s: %w: %s", name, strings.Join(args, " "), err, msg)
	}
	return stdout.String(), nil
}

// netnsDir is where `ip netns` keeps its named namespaces.
const netnsDir = "/run/netns"

// netnsPath returns the bind-mount path of the named namespace.
func netnsPath(ns string) string { return filepath.Join(netnsDir, ns) }

// netnsExists reports whether `ip netns` knows a namespace called ns.
func netnsExists(ns string) (bool, error) {
	_, err := os.Stat(netnsPath(ns))
	if err == nil {
		return true, nil
	}
	if os.IsNotExist(err) {
		return false, nil
	}
	return false, fmt.Errorf("topo: %w", err)
}

// Exec returns a command that runs name with args inside namespace ns
// (via `ip netns exec`), e.g. for iperf3 or ss.
func Exec(ns, name string, args ...string) *exec.Cmd {
	return exec.Command("ip", append([]string{"netns", "exec", ns, name}, args...)...)
}
