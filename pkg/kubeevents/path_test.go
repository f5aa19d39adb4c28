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

package kubeevents

import (
	"errors"
	"net/netip"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/client-go/tools/record"

	"github.com/mpnbd/mpnbd/pkg/mptcp"
)

// TestPath: a path flagged is a Warning, a path recovered a Normal Event,
// each naming the node's own address and the rates in Mbit/s; probes,
// still-slow verdicts and releases are no Event.
func TestPath(t *testing.T) {
	a := netip.MustParseAddr("192.0.2.7")
	for _, tc := range []struct {
		e                mptcp.PathEvent
		typ, reason, msg string
	}{
		{mptcp.PathEvent{Addr: a, Kind: mptcp.PathSlow, Rate: 1.5e6, Best: 110e6, NextProbe: 5 * time.Second},
			corev1.EventTypeWarning, "SlowPathFlagged",
			"the storage path through this node's address 192.0.2.7 delivers 12 Mbit/s, the others 880: its MPTCP endpoint is flagged backup (probed again in 5s)"},
		{mptcp.PathEvent{Addr: a, Kind: mptcp.PathRecovered, Rate: 100e6, Best: 110e6},
			corev1.EventTypeNormal, "SlowPathRecovered",
			"the storage path through this node's address 192.0.2.7 delivers 800 Mbit/s again (the others 880): in use again"},
		{e: mptcp.PathEvent{Addr: a, Kind: mptcp.PathProbe}},
		{e: mptcp.PathEvent{Addr: a, Kind: mptcp.PathStillSlow, Rate: 1e6, Best: 100e6}},
		{e: mptcp.PathEvent{Addr: a, Kind: mptcp.PathGone, MeasureErr: errors.New("gone")}},
	} {
		typ, reason, msg, ok := Path(tc.e)
		if ok != (tc.reason != "") || typ != tc.typ || reason != tc.reason || msg != tc.msg {
			t.Errorf("Path(%s) = %q, %q, %q, %v; want %q, %q, %q", tc.e.Kind, typ, reason, msg, ok, tc.typ, tc.reason, tc.msg)
		}
		// RecordPath records the same, or nothing.
		rec := record.NewFakeRecorder(1)
		RecordPath(rec, &corev1.ObjectReference{Kind: "Node", Name: "n"}, tc.e)
		var got string
		select {
		case got = <-rec.Events:
		default:
		}
		if want := tc.typ + " " + tc.reason + " " + tc.msg; (tc.reason == "" && got != "") || (tc.reason != "" && got != want) {
			t.Errorf("RecordPath(%s) recorded %q", tc.e.Kind, got)
		}
	}
}
