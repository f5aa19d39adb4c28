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

package agent

import (
	"context"
	"fmt"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/mpnbd/mpnbd/api/v1alpha1"
	"github.com/mpnbd/mpnbd/pkg/kubeevents"
	"github.com/mpnbd/mpnbd/pkg/mptcp"
)

// runEndpoints keeps an MPTCP "signal" endpoint on every address of the
// configured storage NICs while the agent runs, so clients join a subflow
// to each. Only those endpoints are touched.
func (a *Agent) runEndpoints(ctx context.Context) error {
	// Port 0: the endpoints announce the port each connection uses, the
	// NBD server's, opened on each address before it is announced.
	d := mptcp.Desired{NICs: a.cfg.SignalNICs, Role: mptcp.RoleServer, StaleLossCount: a.cfg.StaleLossCount}
	if a.cfg.Listeners != nil {
		d.BeforeAdd = a.cfg.Listeners.Follow
	}
	var slow *mptcp.SlowPathPolicy
	if a.cfg.AutoBackup {
		onEvent, stop := a.pathEvents()
		defer stop()
		slow = &mptcp.SlowPathPolicy{OnEvent: onEvent}
	}
	if err := mptcp.Keep(ctx, d, a.log, slow); err != nil {
		return fmt.Errorf("agent: %w", err)
	}
	return nil
}

// pathEvents returns what hears of the slow-path watch's decisions: it
// records a path flagged or recovered as an Event on the agent's
// NBDStorageNode (aggregated: a path flagged again and again is one Event
// with a count), then tells Config.OnPathEvent; and what stops it.
func (a *Agent) pathEvents() (func(mptcp.PathEvent), func()) {
	rec, stop := kubeevents.NewRecorder(a.client, "mpnbd-storage-agent", a.log)
	return func(e mptcp.PathEvent) {
		if typ, reason, msg, ok := kubeevents.Path(e); ok {
			rec.Event(a.storageNodeRef(), typ, reason, msg)
		}
		if a.cfg.OnPathEvent != nil {
			a.cfg.OnPathEvent(e)
		}
	}, stop
}

// storageNodeLookup bounds reading the NBDStorageNode's UID for an Event.
const storageNodeLookup = 5 * time.Second

// storageNodeRef refers to the agent's NBDStorageNode, with its UID
// (kubectl describe finds the Events of an object by it): the one the
// last report saw, else read now; none if the object cannot be read.
func (a *Agent) storageNodeRef() *corev1.ObjectReference {
	uid, _ := a.nodeUID.Load().(types.UID)
	if uid == "" {
		ctx, cancel := context.WithTimeout(context.Background(), storageNodeLookup)
		defer cancel()
		var node v1alpha1.NBDStorageNode
		if err := a.reader.Get(ctx, types.NamespacedName{Name: a.cfg.NodeName}, &node); err != nil {
			a.log.Debug("the Event of a slow path names no UID of the storage node", "error", err)
		} else {
			uid = node.UID
			a.nodeUID.Store(uid)
		}
	}
	return &corev1.ObjectReference{APIVersion: v1alpha1.GroupVersion.String(), Kind: "NBDStorageNode", Name: a.cfg.NodeName, UID: uid}
}
