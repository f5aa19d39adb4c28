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
	"fmt"
	"slices"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/mpnbd/mpnbd/api/v1alpha1"
	"github.com/mpnbd/mpnbd/pkg/driver"
)

// Health of a publication (one node's data path) and of a volume (the
// worst of its publications, or Failed/Unpublished).
const (
	HealthHealthy      = "Healthy"
	HealthUnknown      = "Unknown" // no metrics from the node
	HealthNotAttached  = "NotAttached"
	HealthDegraded     = "Degraded"
	HealthInaccessible = "Inaccessible"
	HealthFailed       = "Failed"      // the NBDVolume's phase
	HealthUnpublished  = "Unpublished" // published to no node
)

// healthRank orders the healths from good to bad.
var healthRank = map[string]int{
	HealthHealthy: 0, HealthUnknown: 1, HealthNotAttached: 2, HealthDegraded: 3, HealthInaccessible: 4, HealthFailed: 5,
}

// Where a Fault was seen.
const (
	FaultDataPath   = "dataPath"   // a node plugin reports the data path down or degraded now
	FaultCondition  = "condition"  // a condition of the NBDVolume is False
	FaultStatus     = "status"     // the NBDVolume's status.code and message
	FaultEvent      = "event"      // a Warning Event of the node plugin on the claim
	FaultReconnects = "reconnects" // the data path reconnected since it was attached
)

// Report is what mpnbdctl prints, as a table or as JSON.
type Report struct {
	Volumes []VolumeReport `json:"volumes"`
	// Nodes are the node plugins' metrics endpoints of the nodes the
	// volumes are published to.
	Nodes    []NodeMetrics `json:"nodes"`
	Warnings []string      `json:"warnings,omitempty"`

	// filtered: Volumes are those --storage-node, --node or --unhealthy
	// kept.
	filtered bool
}

// VolumeReport is one volume.
type VolumeReport struct {
	Name string `json:"name"`
	PV   string `json:"pv,omitempty"`
	// PVC is the claim bound to the PV, NAMESPACE/NAME.
	PVC              string   `json:"pvc,omitempty"`
	StorageNode      string   `json:"storageNode"`
	StorageAddresses []string `json:"storageAddresses,omitempty"`
	StoragePort      int32    `json:"storagePort,omitempty"`
	SizeBytes        int64    `json:"sizeBytes"`
	CapacityBytes    int64    `json:"capacityBytes,omitempty"`
	AccessType       string   `json:"accessType"`
	// RequestedTransport is the StorageClass's transport parameter; what
	// the node got is Publications[].DataPath.Transport.
	RequestedTransport string             `json:"requestedTransport,omitempty"`
	Phase              string             `json:"phase"`
	Health             string             `json:"health"`
	LastFault          *Fault             `json:"lastFault,omitempty"`
	Conditions         []metav1.Condition `json:"conditions,omitempty"`
	// Replication is a replicated volume's record (who is primary, who
	// in sync, the epoch) and where each replica stands.
	Replication  *Replication  `json:"replication,omitempty"`
	Publications []Publication `json:"publications"`
}

// Replication is a replicated volume's replicas: the record that decides
// and each replica's state as the primary reports it.
type Replication struct {
	Epoch    int64                   `json:"epoch,omitempty"`
	Primary  string                  `json:"primary,omitempty"`
	InSync   []string                `json:"inSync"`
	Replicas []v1alpha1.ReplicaState `json:"replicas"`
}

// Publication is the volume on one node it is published to.
type Publication struct {
	Node     string `json:"node"`
	ReadOnly bool   `json:"readOnly,omitempty"`
	// Metrics says whether the node's metrics were read and had the
	// volume (MetricsOK): only then is DataPath set.
	Metrics  string    `json:"metrics"`
	Health   string    `json:"health"`
	DataPath *DataPath `json:"dataPath,omitempty"`
}

// Fault is the last fault of a volume that mpnbdctl can tell.
type Fault struct {
	Source  string     `json:"source"`
	Node    string     `json:"node,omitempty"`
	Message string     `json:"message"`
	Time    *time.Time `json:"time,omitempty"`
}

// buildReport joins the API's view of the volumes with the node plugins'.
func buildReport(inv *inventory, nodes []NodeMetrics) *Report {
	rep := &Report{Volumes: []VolumeReport{}, Nodes: nodes, Warnings: inv.warnings}
	if rep.Nodes == nil {
		rep.Nodes = []NodeMetrics{}
	}
	byNode := map[string]*NodeMetrics{}
	for i := range nodes {
		byNode[nodes[i].Node] = &nodes[i]
	}
	for i := range inv.volumes {
		rep.Volumes = append(rep.Volumes, volumeReport(&inv.volumes[i], inv, byNode))
	}
	rep.Warnings = append(rep.Warnings, strayAttachments(inv, nodes)...)
	return rep
}

// keepUnhealthy leaves the volumes whose health is not Healthy (Unknown
// and Unpublished included), and the nodes they are published to.
func (rep *Report) keepUnhealthy() {
	rep.Volumes = slices.DeleteFunc(rep.Volumes, func(v VolumeReport) bool { return v.Health == HealthHealthy })
	used := map[string]bool{}
	for _, v := range rep.Volumes {
		for _, p := range v.Publications {
			used[p.Node] = true
		}
	}
	rep.Nodes = slices.DeleteFunc(rep.Nodes, func(n NodeMetrics) bool { return !used[n.Node] })
}

func volumeReport(vol *v1alpha1.NBDVolume, inv *inventory, byNode map[string]*NodeMetrics) VolumeReport {
	vr := VolumeReport{
		Name:               vol.Name,
		StorageNode:        vol.Spec.StorageNode,
		SizeBytes:          vol.Spec.SizeBytes,
		CapacityBytes:      vol.Status.CapacityBytes,
		AccessType:         string(vol.Spec.AccessType),
		RequestedTransport: vol.Spec.Parameters[driver.ParamTransport],
		Phase:              string(vol.Status.Phase),
		Conditions:         vol.Status.Conditions,
		Publications:       []Publication{},
	}
	if vr.Phase == "" {
		vr.Phase = string(v1alpha1.VolumePending)
	}
	if e := vol.Status.Export; e != nil {
		vr.StorageAddresses, vr.StoragePort = e.Addresses, e.Port
	}
	if len(vol.Spec.ReplicaNodes) > 0 {
		r := &Replication{InSync: []string{}, Replicas: []v1alpha1.ReplicaState{}}
		if rec := vol.Status.Replication; rec != nil {
			r.Epoch, r.Primary, r.InSync = rec.Epoch, rec.Primary, rec.InSync
		}
		// Every replica the spec places, as reported or, before the
		// primary's first report, unknown.
		for _, n := range vol.Spec.ReplicaNodes {
			st := v1alpha1.ReplicaState{Node: n, State: "Unknown"}
			for _, rs := range vol.Status.Replicas {
				if rs.Node == n {
					st = rs
				}
			}
			r.Replicas = append(r.Replicas, st)
		}
		vr.Replication = r
	}
	if pv := inv.pvs[vol.Name]; pv != nil {
		vr.PV = pv.Name
		if c := pv.Spec.ClaimRef; c != nil {
			vr.PVC = c.Namespace + "/" + c.Name
		}
	}
	for _, p := range vol.Spec.Publications {
		vr.Publications = append(vr.Publications, publication(vol.Name, p, byNode[p.NodeID]))
	}
	vr.Health = volumeHealth(vol, vr.Publications)
	vr.LastFault = lastFault(vol, vr.Publications, inv.events[vol.Name])
	return vr
}

func publication(volume string, p v1alpha1.Publication, n *NodeMetrics) Publication {
	pr := Publication{Node: p.NodeID, ReadOnly: p.ReadOnly, Metrics: MetricsOff, Health: HealthUnknown}
	if n == nil {
		return pr
	}
	pr.Metrics = n.Status
	if n.Status != MetricsOK {
		return pr
	}
	dp := n.volumes[volume]
	if dp == nil {
		pr.Metrics, pr.Health = MetricsNotAttached, HealthNotAttached
		return pr
	}
	pr.DataPath = dp
	switch {
	case dp.Inaccessible:
		pr.Health = HealthInaccessible
	case dp.Degraded:
		pr.Health = HealthDegraded
	default:
		pr.Health = HealthHealthy
	}
	return pr
}

func volumeHealth(vol *v1alpha1.NBDVolume, pubs []Publication) string {
	if vol.Status.Phase == v1alpha1.VolumeFailed {
		return HealthFailed
	}
	if len(pubs) == 0 {
		return HealthUnpublished
	}
	worst := HealthHealthy
	for _, p := range pubs {
		if healthRank[p.Health] > healthRank[worst] {
			worst = p.Health
		}
	}
	return worst
}

// abnormalWhenTrue are the NBDVolume condition types that say something
// is wrong when True: the controller's Degraded and the storage agent's
// DeletionBlocked. Every other condition says so when False.
var abnormalWhenTrue = map[string]bool{v1alpha1.ConditionDegraded: true, "DeletionBlocked": true}

// lastFault is the most telling fault of a volume: a data path down or
// degraded now; else the latest of a failed condition (or status code)
// and a Warning Event on its claim; else past reconnects. nil: none seen.
func lastFault(vol *v1alpha1.NBDVolume, pubs []Publication, events []corev1.Event) *Fault {
	for _, want := range []string{HealthInaccessible, HealthDegraded} {
		for _, p := range pubs {
			if p.Health == want {
				return &Fault{Source: FaultDataPath, Node: p.Node, Message: dataPathFault(p.DataPath)}
			}
		}
	}
	var past []*Fault
	for _, c := range vol.Status.Conditions {
		bad := metav1.ConditionFalse
		if abnormalWhenTrue[c.Type] {
			bad = metav1.ConditionTrue
		}
		if c.Status == bad {
			t := c.LastTransitionTime.Time
			past = append(past, &Fault{Source: FaultCondition, Time: &t,
				Message: fmt.Sprintf("%s=%s %s: %s", c.Type, c.Status, c.Reason, c.Message)})
		}
	}
	if len(past) == 0 && vol.Status.Code != "" {
		past = append(past, &Fault{Source: FaultStatus, Message: vol.Status.Code + ": " + vol.Status.Message})
	}
	if len(events) > 0 {
		e := &events[0]
		t := eventTime(e)
		past = append(past, &Fault{Source: FaultEvent, Node: e.Source.Host, Time: &t,
			Message: fmt.Sprintf("%s: %s", e.Reason, e.Message)})
	}
	if len(past) > 0 {
		// The latest; one without a time (status) only when alone.
		return slices.MaxFunc(past, func(a, b *Fault) int { return faultTime(a).Compare(faultTime(b)) })
	}
	for _, p := range pubs {
		if dp := p.DataPath; dp != nil && dp.Reconnects > 0 {
			return &Fault{Source: FaultReconnects, Node: p.Node,
				Message: fmt.Sprintf("%s: %d reconnects since attach; connected again", dp.Transport, dp.Reconnects)}
		}
	}
	return nil
}

func faultTime(f *Fault) time.Time {
	if f.Time == nil {
		return time.Time{}
	}
	return *f.Time
}

// dataPathFault says what is wrong with an unhealthy data path, in the
// words of the node plugin's NodeGetVolumeHealth.
func dataPathFault(dp *DataPath) string {
	switch {
	case !dp.Connected && dp.OutageSeconds > 0:
		return fmt.Sprintf("%s: disconnected from the storage node for %v", dp.Transport,
			(time.Duration(dp.OutageSeconds * float64(time.Second))).Round(time.Second))
	case !dp.Connected:
		return dp.Transport + ": disconnected from the storage node"
	case dp.Inaccessible:
		return dp.Transport + ": inaccessible"
	}
	if want := dp.ExpectedSubflows; want != nil {
		for _, c := range dp.Connections {
			if c.Subflows < *want {
				return fmt.Sprintf("%s: connection %d has %d MPTCP subflows, want %d (one per storage address)",
					dp.Transport, c.Index, c.Subflows, *want)
			}
		}
	}
	return dp.Transport + ": degraded (missing MPTCP subflows)"
}

// strayAttachments warns of volumes a node plugin has attached on a node
// they are not published to (the fence should prevent it), or that have
// no NBDVolume at all (listing volumes only).
func strayAttachments(inv *inventory, nodes []NodeMetrics) []string {
	published := map[[2]string]bool{}
	known := map[string]bool{}
	for _, v := range inv.all {
		known[v.Name] = true
		for _, p := range v.Spec.Publications {
			published[[2]string{v.Name, p.NodeID}] = true
		}
	}
	var out []string
	for _, n := range nodes {
		var ids []string
		for id := range n.volumes {
			ids = append(ids, id)
		}
		slices.Sort(ids)
		for _, id := range ids {
			switch {
			case published[[2]string{id, n.Node}]:
			case known[id]:
				out = append(out, fmt.Sprintf("node %s has volume %s attached, but it is not published to that node", n.Node, id))
			case !inv.single:
				out = append(out, fmt.Sprintf("node %s has volume %s attached, but there is no NBDVolume %s", n.Node, id, id))
			}
		}
	}
	return out
}

// formatBytes writes a size in binary units: 10Gi, 1.5Gi, 512.
func formatBytes(n int64) string {
	const units = "KMGTPE"
	if n < 1024 {
		return fmt.Sprint(n)
	}
	v, u := float64(n), -1
	for v >= 1024 && u < len(units)-1 {
		v /= 1024
		u++
	}
	s := fmt.Sprintf("%.1f", v)
	s = strings.TrimSuffix(s, ".0")
	return s + string(units[u]) + "i"
}
