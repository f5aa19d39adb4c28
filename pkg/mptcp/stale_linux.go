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

package mptcp

import (
	"fmt"
	"os"
	"strconv"
	"strings"
)

// staleLossCountPath is the calling thread's network namespace's setting.
const staleLossCountPath = "/proc/sys/net/mptcp/stale_loss_cnt"

// RaiseStaleLossCount raises the calling thread's network namespace's
// net.mptcp.stale_loss_cnt to n if it is lower (a larger value an
// administrator chose stays) and returns the value it had.
func RaiseStaleLossCount(n int) (int, error) {
	b, err := os.ReadFile(staleLossCountPath)
	if err != nil {
		return 0, err
	}
	old, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil {
		return 0, fmt.Errorf("%s: %q: %w", staleLossCountPath, b, err)
	}
	if old >= n {
		return old, nil
	}
	if err := os.WriteFile(staleLossCountPath, []byte(strconv.Itoa(n)), 0o644); err != nil {
		return old, err
	}
	return old, nil
}
