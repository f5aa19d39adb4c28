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
	"fmt"
	"os/exec"
	"strings"
	"testing"
)

// A host that loses power, or a path whose switch dies, sends no reset
// and no ICMP: its peers see silence, and TCP retransmits into it for
// many minutes. Taking a link down is not that (the kernel reports it
// at once), so fault tests make silence with nftables rules that drop
// packets without a word.

// RequireNft skips the test (printing the reason) unless nft is installed.
func RequireNft(t testing.TB) {
	t.Helper()
	if _, err := exec.LookPath("nft"); err != nil {
		t.Skipf("skipping: nft (nftables) not found: %v", err)
	}
}

// Drop makes namespace ns drop every packet it receives and every packet
// it sends on interface ifname ("" means every interface, loopback
// included), silently, until Undrop with the same table. table names the
// nftables table that holds the rules, so that several drops can be
// lifted one by one.
func Drop(ns, table, ifname string) error {
	in, out := "drop", "drop"
	if ifname != "" {
		in = fmt.Sprintf("iifname %q drop", ifname)
		out = fmt.Sprintf("oifname %q drop", ifname)
	}
	script := fmt.Sprintf(`table inet %s {
	chain in { type filter hook input priority -300; policy accept; %s; }
	chain out { type filter hook output priority -300; policy accept; %s; }
}
`, table, in, out)
	return applyNft(ns, script)
}

// applyNft loads an nftables script into namespace ns.
func applyNft(ns, script string) error {
	cmd := Exec(ns, "nft", "-f", "-")
	cmd.Stdin = strings.NewReader(script)
	if b, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("topo: nft in %s: %w: %s", ns, err, b)
	}
	return nil
}

// Undrop removes the rules Drop put in table.
func Undrop(ns, table string) error {
	if b, err := Exec(ns, "nft", "delete", "table", "inet", table).CombinedOutput(); err != nil {
		return fmt.Errorf("topo: nft in %s: %w: %s", ns, err, b)
	}
	return nil
}
