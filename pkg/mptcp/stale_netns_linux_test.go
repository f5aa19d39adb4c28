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

package mptcp_test

import (
	"context"
	"log/slog"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/mpnbd/mpnbd/internal/testenv/topo"
	"github.com/mpnbd/mpnbd/pkg/mptcp"
)

// staleLossCount reads net.mptcp.stale_loss_cnt of namespace ns ("" for
// the test's own).
func staleLossCount(t *testing.T, ns string) string {
	t.Helper()
	if ns == "" {
		b, err := os.ReadFile("/proc/sys/net/mptcp/stale_loss_cnt")
		if err != nil {
			t.Fatal(err)
		}
		return strings.TrimSpace(string(b))
	}
	out, err := exec.Command("ip", "netns", "exec", ns, "sysctl", "-n", "net.mptcp.stale_loss_cnt").CombinedOutput()
	if err != nil {
		t.Fatalf("sysctl in %s: %v: %s", ns, err, out)
	}
	return strings.TrimSpace(string(out))
}

// Keep raises its namespace's stale_loss_cnt to Desired.StaleLossCount
// and leaves other namespaces alone; RaiseStaleLossCount never lowers a
// larger value.
func TestKeepRaisesStaleLossCount(t *testing.T) {
	ns := newTestNS(t)
	host := staleLossCount(t, "")
	if got := staleLossCount(t, ns.name); got != "4" {
		t.Skipf("skipping: a new namespace starts with stale_loss_cnt %s, not the kernel's default 4", got)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- topo.InNetns(ns.name, func() error {
			return mptcp.Keep(ctx, mptcp.Desired{NICs: []mptcp.NICSpec{"b0"}, Role: mptcp.RoleClient, StaleLossCount: 8},
				slog.New(slog.DiscardHandler), nil)
		})
	}()
	deadline := time.Now().Add(10 * time.Second)
	for staleLossCount(t, ns.name) != "8" {
		if time.Now().After(deadline) {
			cancel()
			t.Fatalf("stale_loss_cnt of Keep's namespace is %s 10 s after it started, want 8", staleLossCount(t, ns.name))
		}
		time.Sleep(50 * time.Millisecond)
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("Keep: %v", err)
	}
	if got := staleLossCount(t, ""); got != host {
		t.Errorf("the test's own namespace's stale_loss_cnt changed from %s to %s", host, got)
	}

	if out, err := exec.Command("ip", "netns", "exec", ns.name, "sysctl", "-qw", "net.mptcp.stale_loss_cnt=20").CombinedOutput(); err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	err := topo.InNetns(ns.name, func() error {
		old, err := mptcp.RaiseStaleLossCount(8)
		if err == nil && old != 20 {
			t.Errorf("RaiseStaleLossCount returned %d as the value before, want 20", old)
		}
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	if got := staleLossCount(t, ns.name); got != "20" {
		t.Errorf("RaiseStaleLossCount(8) over 20 left %s, want 20 kept", got)
	}
}
