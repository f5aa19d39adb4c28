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

package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"slices"
	"strings"
	"time"

	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/mpnbd/mpnbd/api/v1alpha1"
)

// errNotDrained: drain ended with volumes still on the node.
var errNotDrained = errors.New("not drained")

// setMaintenance writes the storage node's cordon and drain fields (the
// controller does the moving; docs/replication.md).
func setMaintenance(ctx context.Context, api client.Client, node string, unschedulable, drain bool) error {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	b, err := json.Marshal(map[string]any{"spec": map[string]any{"unschedulable": unschedulable, "drain": drain}})
	if err != nil {
		return err
	}
	err = api.Patch(ctx, &v1alpha1.NBDStorageNode{ObjectMeta: metav1.ObjectMeta{Name: node}}, client.RawPatch(types.MergePatchType, b))
	if err != nil {
		return fmt.Errorf("storage node %s: %w", node, err)
	}
	return nil
}

// heldVolume is one volume a storage node holds, and how.
type heldVolume struct {
	name string
	// role: rolePrimary, roleReplica or roleUnreplicated.
	role string
	// copying: nodes of the volume whose copy is not in sync yet.
	copying []string
}

// heldBy lists the volumes that hold data on node, by name.
func heldBy(vols []v1alpha1.NBDVolume, node string) []heldVolume {
	var out []heldVolume
	for _, v := range vols {
		h := heldVolume{name: v.Name}
		switch {
		case v.Spec.StorageNode == node && len(v.Spec.ReplicaNodes) == 0:
			h.role = roleUnreplicated
		case v.Spec.StorageNode == node:
			h.role = rolePrimary
		case slices.Contains(v.Spec.ReplicaNodes, node):
			h.role = roleReplica
		default:
			continue
		}
		if rec := v.Status.Replication; rec != nil {
			for _, n := range append([]string{v.Spec.StorageNode}, v.Spec.ReplicaNodes...) {
				if n != node && !slices.Contains(rec.InSync, n) {
					h.copying = append(h.copying, n)
				}
			}
		}
		out = append(out, h)
	}
	slices.SortFunc(out, func(a, b heldVolume) int { return strings.Compare(a.name, b.name) })
	return out
}

// describeHeld is one line of what node still holds.
func describeHeld(held []heldVolume) string {
	parts := make([]string, len(held))
	for i, h := range held {
		parts[i] = h.name + " (" + h.role
		if len(h.copying) > 0 {
			parts[i] += ", copying to " + strings.Join(h.copying, ",")
		}
		parts[i] += ")"
	}
	return strings.Join(parts, ", ")
}

// drain marks node draining and, for up to wait, follows the controller
// moving its volumes and replicas away, printing what the node still
// holds each time that changes. It fails (errNotDrained) if the node
// still holds volumes when the wait ends.
func drain(ctx context.Context, api client.Client, node string, wait, poll time.Duration, w io.Writer) error {
	if err := setMaintenance(ctx, api, node, true, true); err != nil {
		return err
	}
	fmt.Fprintf(w, "storage node %s draining: cordoned, its volumes and replicas move to other storage nodes (a copy made in sync first)\n", node)
	if wait <= 0 {
		return nil
	}
	end := time.Now().Add(wait)
	last := "-"
	for {
		lctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		var vols v1alpha1.NBDVolumeList
		err := api.List(lctx, &vols)
		cancel()
		if err != nil {
			return fmt.Errorf("listing NBDVolumes: %w", err)
		}
		held := heldBy(vols.Items, node)
		if now := describeHeld(held); now != last {
			last = now
			if len(held) == 0 {
				fmt.Fprintf(w, "storage node %s drained: it holds no volume\n", node)
				return nil
			}
			fmt.Fprintf(w, "%s holds %d volume(s): %s\n", node, len(held), now)
		}
		if time.Now().After(end) {
			return fmt.Errorf("%w: after %v %s still holds %s (the drain goes on)", errNotDrained, wait, node, describeHeld(held))
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(poll):
		}
	}
}

// errAgentReports: forget refused, the node's agent still reports.
var errAgentReports = errors.New("its storage agent reports")

// forget deletes storage node node's NBDStorageNode once the controller
// says its agent is gone (Ready False, AgentNotReporting: the lease not
// renewed), conditional on the object read; the controller then takes the
// node as lost for good (docs/operations.md). It prints what that does to
// each volume the node held.
func forget(ctx context.Context, api client.Client, node string, w io.Writer) error {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	var sn v1alpha1.NBDStorageNode
	if err := api.Get(ctx, client.ObjectKey{Name: node}, &sn); err != nil {
		return fmt.Errorf("storage node %s: %w", node, err)
	}
	ready := meta.FindStatusCondition(sn.Status.Conditions, v1alpha1.ConditionReady)
	if ready == nil || ready.Status != metav1.ConditionFalse || ready.Reason != v1alpha1.ReasonAgentNotReporting {
		state := "no Ready condition yet"
		if ready != nil {
			state = fmt.Sprintf("Ready %s (%s)", ready.Status, ready.Reason)
		}
		return fmt.Errorf("storage node %s: %w (%s): forget is for a node gone for good, whose agent's lease the controller sees expire; stop its agent first, or drain it (mpnbdctl drain %s)",
			node, errAgentReports, state, node)
	}
	var vols v1alpha1.NBDVolumeList
	if err := api.List(ctx, &vols); err != nil {
		return fmt.Errorf("listing NBDVolumes: %w", err)
	}
	held := heldBy(vols.Items, node)
	rv := sn.ResourceVersion
	if err := api.Delete(ctx, &sn, client.Preconditions{UID: &sn.UID, ResourceVersion: &rv}); err != nil {
		return fmt.Errorf("deleting storage node %s: %w", node, err)
	}
	fmt.Fprintf(w, "storage node %s forgotten (not reporting since %s): the controller takes it as lost for good\n", node, ready.LastTransitionTime.UTC().Format(time.RFC3339))
	for _, h := range held {
		var what string
		switch h.role {
		case roleUnreplicated:
			what = "its only copy is lost with the node: its publications are released and deleting its claim writes its data off; a node that has it attached keeps waiting on it"
		case rolePrimary:
			what = "a replica in sync takes over as primary (if none is alive, the volume waits); the lost copy is replaced"
		case roleReplica:
			what = "its replica is replaced on another storage node, copied whole from the primary"
		}
		fmt.Fprintf(w, "  %s (%s): %s\n", h.name, h.role, what)
	}
	if len(held) == 0 {
		fmt.Fprintf(w, "  it held no volume\n")
	}
	fmt.Fprintf(w, "if its agent ever runs again it makes the NBDStorageNode anew and reports the files it still holds as orphans\n")
	return nil
}
