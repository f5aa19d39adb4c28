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
	"fmt"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/tools/record"

	"github.com/mpnbd/mpnbd/pkg/mptcp"
)

// The reasons of the slow-path watch's Events, on a node plugin's Node
// and on a storage agent's NBDStorageNode.
const (
	ReasonSlowPathFlagged   = "SlowPathFlagged"
	ReasonSlowPathRecovered = "SlowPathRecovered"
)

// Path words the Event that tells of the slow-path watch's decision e
// (mptcp.SlowPathPolicy.OnEvent), the same on both ends of the storage
// network: e.Addr is one of the reporting node's own addresses (a storage
// NIC's on a node plugin's node, a signal address on a storage node).
// Only a path flagged and a path recovered are told (ok); probes and
// releases are not.
func Path(e mptcp.PathEvent) (eventType, reason, message string, ok bool) {
	switch e.Kind {
	case mptcp.PathSlow:
		return corev1.EventTypeWarning, ReasonSlowPathFlagged,
			fmt.Sprintf("the storage path through this node's address %s delivers %.0f Mbit/s, the others %.0f: its MPTCP endpoint is flagged backup (probed again in %v)",
				e.Addr, mbits(e.Rate), mbits(e.Best), e.NextProbe), true
	case mptcp.PathRecovered:
		return corev1.EventTypeNormal, ReasonSlowPathRecovered,
			fmt.Sprintf("the storage path through this node's address %s delivers %.0f Mbit/s again (the others %.0f): in use again",
				e.Addr, mbits(e.Rate), mbits(e.Best)), true
	}
	return "", "", "", false
}

// RecordPath records on obj the Event of e (Path), if it has one.
func RecordPath(rec record.EventRecorder, obj runtime.Object, e mptcp.PathEvent) {
	if typ, reason, msg, ok := Path(e); ok {
		rec.Event(obj, typ, reason, msg)
	}
}

// mbits is a rate in bytes per second in Mbit/s.
func mbits(bytesPerSecond float64) float64 { return bytesPerSecond * 8 / 1e6 }
