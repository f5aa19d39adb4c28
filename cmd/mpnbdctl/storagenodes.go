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
	"fmt"
	"io"
	"slices"
	"strconv"
	"strings"
	"time"

	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/mpnbd/mpnbd/api/v1alpha1"
)

// Roles of a volume on a storage node (heldVolume.role).
const (
	rolePrimary      = "primary"
	roleUnreplicated = "unreplicated"
	roleReplica      = "replica"
)

// StorageNodesReport is what `mpnbdctl storage-nodes` prints.
type StorageNodesReport struct {
	StorageNodes []StorageNodeReport `json:"storageNodes"`
	Warnings     []string            `json:"warnings,omitempty"`
}

// StorageNodeReport is one NBDStorageNode and what it holds.
type StorageNodeReport struct {
	Name string `json:"name"`
	// Ready is the status of the Ready condition the controller sets
	// from the agent's lease: True, False, or Unknown while it has set
	// none; Reason, Message and Since (its last transition) are the
	// condition's.
	Ready   string     `json:"ready"`
	Reason  string     `json:"reason,omitempty"`
	Message string     `json:"message,omitempty"`
	Since   *time.Time `json:"since,omitempty"`
	// Heartbeat is when the agent last reported.
	Heartbeat *time.Time `json:"heartbeat,omitempty"`
	// Cordoned and Draining are spec.unschedulable and spec.drain.
	Cordoned       bool  `json:"cordoned"`
	Draining       bool  `json:"draining"`
	CapacityBytes  int64 `json:"capacityBytes"`
	AvailableBytes int64 `json:"availableBytes"`
	// Primaries counts the replicated volumes it serves as primary,
	// Unreplicated the volumes whose only copy it holds, Replicas the
	// replicas it holds of volumes served by others.
	Primaries    int `json:"primaries"`
	Unreplicated int `json:"unreplicated"`
	Replicas     int `json:"replicas"`
	// Orphans counts its backing files with no NBDVolume, OrphanFiles
	// names them.
	Orphans     int      `json:"orphans"`
	OrphanFiles []string `json:"orphanFiles,omitempty"`
}

// storageNodeColumns are the columns of `mpnbdctl storage-nodes`.
var storageNodeColumns = []string{
	"NAME", "READY", "REASON", "CORDONED", "DRAINING", "CAPACITY", "AVAILABLE", "PRIMARIES", "UNREPLICATED", "REPLICAS", "ORPHANS",
}

// storageNodes reads the storage nodes and the volumes, each list within
// o.timeout, and writes the report in o.output.
func storageNodes(ctx context.Context, o *options, api client.Reader, w io.Writer) error {
	call := func(l client.ObjectList) error {
		ctx, cancel := context.WithTimeout(ctx, o.timeout)
		defer cancel()
		return api.List(ctx, l)
	}
	var nodes v1alpha1.NBDStorageNodeList
	if err := call(&nodes); err != nil {
		return apiError("listing NBDStorageNodes", err)
	}
	var vols v1alpha1.NBDVolumeList
	if err := call(&vols); err != nil {
		return apiError("listing NBDVolumes", err)
	}
	rep := buildStorageNodes(nodes.Items, vols.Items)
	if o.output == outputJSON {
		return writeJSON(w, rep)
	}
	return writeStorageNodes(w, rep)
}

// buildStorageNodes joins the storage nodes with the volumes they hold.
func buildStorageNodes(nodes []v1alpha1.NBDStorageNode, vols []v1alpha1.NBDVolume) *StorageNodesReport {
	rep := &StorageNodesReport{StorageNodes: []StorageNodeReport{}}
	known := map[string]bool{}
	for i := range nodes {
		sn := &nodes[i]
		known[sn.Name] = true
		r := StorageNodeReport{
			Name: sn.Name, Ready: string(metav1.ConditionUnknown),
			Cordoned: sn.Spec.Unschedulable, Draining: sn.Spec.Drain,
			CapacityBytes: sn.Status.CapacityBytes, AvailableBytes: sn.Status.AvailableBytes,
			Orphans: len(sn.Status.Orphans), OrphanFiles: sn.Status.Orphans,
		}
		if c := meta.FindStatusCondition(sn.Status.Conditions, v1alpha1.ConditionReady); c != nil {
			r.Ready, r.Reason, r.Message = string(c.Status), c.Reason, c.Message
			if !c.LastTransitionTime.IsZero() {
				t := c.LastTransitionTime.UTC()
				r.Since = &t
			}
		}
		if !sn.Status.Heartbeat.IsZero() {
			t := sn.Status.Heartbeat.UTC()
			r.Heartbeat = &t
		}
		for _, h := range heldBy(vols, sn.Name) {
			switch h.role {
			case rolePrimary:
				r.Primaries++
			case roleUnreplicated:
				r.Unreplicated++
			case roleReplica:
				r.Replicas++
			}
		}
		rep.StorageNodes = append(rep.StorageNodes, r)
	}
	slices.SortFunc(rep.StorageNodes, func(a, b StorageNodeReport) int { return strings.Compare(a.Name, b.Name) })

	// Storage nodes the volumes name that have no NBDStorageNode: lost
	// for good (forgotten), or whose agent has never reported.
	var missing []string
	for _, v := range vols {
		for _, n := range append([]string{v.Spec.StorageNode}, v.Spec.ReplicaNodes...) {
			if n != "" && !known[n] && !slices.Contains(missing, n) {
				missing = append(missing, n)
			}
		}
	}
	slices.Sort(missing)
	for _, n := range missing {
		held := heldBy(vols, n)
		rep.Warnings = append(rep.Warnings, fmt.Sprintf("storage node %s has no NBDStorageNode (lost for good, or its agent has not reported yet) but holds %d volume(s): %s",
			n, len(held), describeHeld(held)))
	}
	return rep
}

// writeStorageNodes writes the storage nodes as a table, then what needs
// a look: a node not Ready, orphan files, the warnings.
func writeStorageNodes(w io.Writer, rep *StorageNodesReport) error {
	var notes []string
	if len(rep.StorageNodes) == 0 {
		fmt.Fprintln(w, "No NBDStorageNodes: no storage agent has reported.")
	} else {
		tw := newTabWriter(w)
		row(tw, "", storageNodeColumns...)
		for _, n := range rep.StorageNodes {
			row(tw, "", n.Name, n.Ready, n.Reason, yesNo(n.Cordoned), yesNo(n.Draining),
				formatBytes(n.CapacityBytes), formatBytes(n.AvailableBytes), strconv.Itoa(n.Primaries),
				strconv.Itoa(n.Unreplicated), strconv.Itoa(n.Replicas), strconv.Itoa(n.Orphans))
		}
		if err := tw.Flush(); err != nil {
			return err
		}
	}
	for _, n := range rep.StorageNodes {
		if n.Ready != string(metav1.ConditionTrue) {
			s := fmt.Sprintf("Storage node %s: Ready %s", n.Name, n.Ready)
			if n.Reason != "" {
				s += " (" + n.Reason + ")"
			}
			if n.Since != nil {
				s += " since " + timeText(*n.Since)
			}
			if n.Message != "" {
				s += ": " + n.Message
			}
			notes = append(notes, s)
		}
		if n.Orphans > 0 {
			notes = append(notes, fmt.Sprintf("Storage node %s: %d orphan file(s), backing files with no NBDVolume, never deleted by the driver: %s",
				n.Name, n.Orphans, strings.Join(n.OrphanFiles, ", ")))
		}
	}
	return printNotes(w, notes, rep.Warnings)
}
