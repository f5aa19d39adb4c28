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

package v1alpha1

import (
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// VolumePhase is where a volume is in its life.
type VolumePhase string

const (
	// VolumePending: accepted, not yet created on its storage node.
	VolumePending VolumePhase = "Pending"
	// VolumeAvailable: the backing store exists and the export is open.
	VolumeAvailable VolumePhase = "Available"
	// VolumeFailed: the storage agent could not create or serve it; see
	// Status.Code and Status.Message.
	VolumeFailed VolumePhase = "Failed"
	// VolumeDeleting: deletion requested; the agent drains and removes it.
	VolumeDeleting VolumePhase = "Deleting"
)

// AccessType is how the volume is consumed.
type AccessType string

const (
	AccessFilesystem AccessType = "Filesystem"
	AccessBlock      AccessType = "Block"
)

// ContentSource is what a new volume is filled from. Both are object
// names (DNS-1123 subdomains): the storage agent finds the source's file
// under its data directory by name, so a path is refused here and there.
type ContentSource struct {
	// Volume is the name of an existing NBDVolume to clone.
	// +optional
	// +kubebuilder:validation:MaxLength=253
	// +kubebuilder:validation:Pattern=`^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$`
	Volume string `json:"volume,omitempty"`
	// Snapshot is the name of an NBDSnapshot to restore.
	// +optional
	// +kubebuilder:validation:MaxLength=253
	// +kubebuilder:validation:Pattern=`^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$`
	Snapshot string `json:"snapshot,omitempty"`
}

// Publication grants one node access to the volume's export.
type Publication struct {
	// NodeID is the CSI node ID (the Kubernetes node name).
	// +kubebuilder:validation:MinLength=1
	NodeID string `json:"nodeID"`
	// SecretRef names the Secret holding the per-(volume, node) token that
	// the node presents in the export name. The token itself never appears
	// in this resource. Empty: the node proves who it is with its node
	// certificate over TLS instead (no token exists).
	// +optional
	SecretRef string `json:"secretRef,omitempty"`
	// TokenSHA256 is the SHA-256 (64 hex digits) of the token in that
	// Secret. The storage agent checks a node's token against it and so
	// never holds the token itself: it cannot open the export as the
	// node, and it needs no access to Secrets. Set by the controller with
	// the Secret (and added by it to publications made before it existed).
	// +kubebuilder:validation:Pattern=`^[0-9a-f]{64}$`
	// +optional
	TokenSHA256 string `json:"tokenSHA256,omitempty"`
	// Addresses are the node's storage addresses; connections from other
	// addresses are refused.
	// +optional
	Addresses []string `json:"addresses,omitempty"`
	// ReadOnly publishes the volume read-only to this node.
	// +optional
	ReadOnly bool `json:"readOnly,omitempty"`
	// Epoch tells this publication from every earlier one of the volume
	// (to this node or another): the volume's metadata.generation when it
	// was made, so it rises with every publish. The node presents it in
	// the export name it asks for; the storage agent refuses a connection
	// presenting an older one as superseded, and the node's data path
	// then fails its I/O instead of redialing. 0: made before epochs
	// existed, and connections present none.
	// +kubebuilder:validation:Minimum=0
	// +optional
	Epoch int64 `json:"epoch,omitempty"`
}

// Encryption is an NBDVolume's encryption in transit.
type Encryption string

// The encryption settings of a volume.
const (
	EncryptionNone      Encryption = "none"
	EncryptionPreferred Encryption = "preferred"
	EncryptionRequired  Encryption = "required"
)

// NBDVolumeSpec is the desired state of a volume.
type NBDVolumeSpec struct {
	// SizeBytes is the requested size. Growing it expands the volume.
	// +kubebuilder:validation:Minimum=1
	SizeBytes int64 `json:"sizeBytes"`
	// StorageNode is the node whose storage agent holds the volume (for a
	// replicated volume, the first replica's, its primary at first).
	// +kubebuilder:validation:MinLength=1
	StorageNode string `json:"storageNode"`
	// Replicas is how many storage nodes hold the volume's data: 1 (the
	// default) to 3, on StorageNode and ReplicaNodes.
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=3
	// +optional
	Replicas int32 `json:"replicas,omitempty"`
	// ReplicaNodes are the storage nodes of the other replicas, each
	// distinct from StorageNode and from the others: Replicas-1 of them,
	// one more while a replica moves (a drain makes the new copy before
	// the old one goes).
	// +kubebuilder:validation:MaxItems=3
	// +listType=set
	// +optional
	ReplicaNodes []string `json:"replicaNodes,omitempty"`
	// AccessType is Filesystem or Block.
	// +kubebuilder:validation:Enum=Filesystem;Block
	AccessType AccessType `json:"accessType"`
	// MultiNode allows publishing to more than one node at once.
	// +optional
	MultiNode bool `json:"multiNode,omitempty"`
	// Parameters are the StorageClass parameters the volume was made with
	// (validated), kept so CreateVolume is idempotent by name.
	// +optional
	Parameters map[string]string `json:"parameters,omitempty"`
	// Encryption is whether the volume's connections are encrypted:
	// required (the storage agent serves it only over TLS, to nodes that
	// present their node certificate), preferred, or none (the default).
	// +kubebuilder:validation:Enum=none;preferred;required
	// +optional
	Encryption Encryption `json:"encryption,omitempty"`
	// ContentSource fills a new volume from a volume or snapshot.
	// +optional
	ContentSource *ContentSource `json:"contentSource,omitempty"`
	// Publications lists the nodes allowed to open the export.
	// +optional
	// +listType=map
	// +listMapKey=nodeID
	Publications []Publication `json:"publications,omitempty"`
}

// Export is where and how the volume is served.
type Export struct {
	// Name is the export's base name; a node adds its token.
	Name string `json:"name"`
	// Port is the server's NBD port.
	Port int32 `json:"port"`
	// Addresses are the storage node's storage addresses; the first is
	// dialled, the others join as MPTCP subflows.
	Addresses []string `json:"addresses"`
}

// NBDVolumeStatus is what the storage agent reports.
type NBDVolumeStatus struct {
	// +optional
	Phase VolumePhase `json:"phase,omitempty"`
	// CapacityBytes is the size of the backing store.
	// +optional
	CapacityBytes int64 `json:"capacityBytes,omitempty"`
	// +optional
	Export *Export `json:"export,omitempty"`
	// Code is a gRPC code name (e.g. ResourceExhausted) when the agent
	// failed, so the controller returns the right code.
	// +optional
	Code string `json:"code,omitempty"`
	// +optional
	Message string `json:"message,omitempty"`
	// ObservedGeneration is the spec generation the status describes.
	// +optional
	ObservedGeneration int64 `json:"observedGeneration,omitempty"`
	// +optional
	// +listType=map
	// +listMapKey=type
	Conditions []metav1.Condition `json:"conditions,omitempty"`
	// Replication is the arbiter's record of a replicated volume's
	// replicas (docs/replication.md): which one is primary, which are in
	// sync, and the epoch of that decision. Changed only by conditional
	// updates, each raising the epoch.
	// +optional
	Replication *ReplicationStatus `json:"replication,omitempty"`
	// Replicas is where each of a replicated volume's other replicas
	// stands, as its primary sees it: in sync, out (and what it lacks),
	// being rebuilt (and how far). Written by the primary's agent;
	// Replication is what decides.
	// +optional
	// +listType=map
	// +listMapKey=node
	Replicas []ReplicaState `json:"replicas,omitempty"`
	// Attachments are the nodes that have the volume attached, with their
	// data path. Each entry is written by its own node's plugin alone
	// (server-side apply, field manager mpnbd-node/<node>), so the agent's
	// status writes and the other nodes' never touch it.
	// +optional
	// +listType=map
	// +listMapKey=nodeID
	Attachments []NodeAttachment `json:"attachments,omitempty"`
}

// ReplicationStatus is the record that decides a replicated volume's
// primary and in-sync set.
type ReplicationStatus struct {
	// Epoch rises with every change of the primary or of the in-sync set.
	// A replica refuses the requests of an older epoch, and a primary
	// whose epoch is not this one any more acknowledges nothing.
	// +kubebuilder:validation:Minimum=1
	Epoch int64 `json:"epoch"`
	// Primary is the storage node that serves the nodes and forwards
	// every change to the others in sync.
	Primary string `json:"primary"`
	// PrimaryEpoch is the epoch of the decision that made Primary the
	// primary. A replica serves the primary's forwards named with an
	// epoch from PrimaryEpoch to Epoch (its own drops and rejoins raise
	// Epoch, not PrimaryEpoch) and closes, and refuses, any older one: an
	// earlier primary's, whatever changes the replica's watch missed.
	// +kubebuilder:validation:Minimum=1
	PrimaryEpoch int64 `json:"primaryEpoch"`
	// InSync are the storage nodes whose copy holds every acknowledged
	// change, the primary among them. Only one of them can become primary.
	// +listType=set
	InSync []string `json:"inSync"`
	// InSyncReplicas is len(InSync), for kubectl get.
	InSyncReplicas int32 `json:"inSyncReplicas"`
}

// ReplicaState is one replica of a replicated volume as its primary sees
// it.
type ReplicaState struct {
	// Node is the replica's storage node.
	// +kubebuilder:validation:MinLength=1
	Node string `json:"node"`
	// State is InSync, Leaving (failed; its leaving being recorded), Out
	// or Rebuilding.
	// +kubebuilder:validation:Enum=InSync;Leaving;Out;Rebuilding
	State string `json:"state"`
	// LackingBytes is what a replica out of the in-sync set lacks: the
	// regions changed since it left, which its rebuild copies.
	// +optional
	LackingBytes int64 `json:"lackingBytes,omitempty"`
	// RebuildCopiedBytes and RebuildTotalBytes are the progress of the
	// rebuild under way.
	// +optional
	RebuildCopiedBytes int64 `json:"rebuildCopiedBytes,omitempty"`
	// +optional
	RebuildTotalBytes int64 `json:"rebuildTotalBytes,omitempty"`
}

// NodeAttachment is one node's data path to a volume, as its node plugin
// sees it: written when the volume is staged, updated when the transport,
// subflows or connectivity change, removed when it is unstaged.
type NodeAttachment struct {
	// NodeID is the CSI node ID (the Kubernetes node name).
	// +kubebuilder:validation:MinLength=1
	NodeID string `json:"nodeID"`
	// Transport is how the node attached the volume (kernel, ublk, relay,
	// multiconn, tcp or fuse).
	Transport string `json:"transport"`
	// Subflows are the MPTCP subflows of each of the volume's connections
	// against the number a healthy one has (the storage node's
	// addresses): "4/4", or "4/4,3/4" for two connections; "?" when the
	// node does not know that number. Empty when the data path does not
	// run over MPTCP or has no connection.
	// +optional
	Subflows string `json:"subflows,omitempty"`
	// Connected says whether the data path reaches the storage node (I/O
	// waits while it does not).
	Connected bool `json:"connected"`
	// LastUpdateTime is when the node last changed this entry.
	LastUpdateTime metav1.Time `json:"lastUpdateTime"`
}

// NBDVolume is one CSI volume: a backing store on a storage node served as
// an NBD export over MPTCP.
// +kubebuilder:object:root=true
// +kubebuilder:resource:scope=Cluster,shortName=nbdvol
// +kubebuilder:selectablefield:JSONPath=`.spec.storageNode`
// +kubebuilder:subresource:status
// +kubebuilder:printcolumn:name="Node",type=string,JSONPath=`.spec.storageNode`
// +kubebuilder:printcolumn:name="Size",type=integer,JSONPath=`.spec.sizeBytes`
// +kubebuilder:printcolumn:name="Phase",type=string,JSONPath=`.status.phase`
// +kubebuilder:printcolumn:name="Reachable",type=string,JSONPath=`.status.conditions[?(@.type=="Reachable")].status`
// +kubebuilder:printcolumn:name="Degraded",type=string,JSONPath=`.status.conditions[?(@.type=="Degraded")].status`,priority=1
// +kubebuilder:printcolumn:name="Replicas",type=integer,JSONPath=`.spec.replicas`
// +kubebuilder:printcolumn:name="InSync",type=integer,JSONPath=`.status.replication.inSyncReplicas`
// +kubebuilder:printcolumn:name="Primary",type=string,JSONPath=`.status.replication.primary`,priority=1
// +kubebuilder:printcolumn:name="Published",type=string,JSONPath=`.spec.publications[*].nodeID`
// +kubebuilder:printcolumn:name="Transport",type=string,JSONPath=`.status.attachments[*].transport`,priority=1
// +kubebuilder:printcolumn:name="Subflows",type=string,JSONPath=`.status.attachments[*].subflows`,priority=1
// +kubebuilder:printcolumn:name="Age",type=date,JSONPath=`.metadata.creationTimestamp`
type NBDVolume struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata,omitempty"`

	Spec   NBDVolumeSpec   `json:"spec"`
	Status NBDVolumeStatus `json:"status,omitempty"`
}

// NBDVolumeList is a list of NBDVolume.
// +kubebuilder:object:root=true
type NBDVolumeList struct {
	metav1.TypeMeta `json:",inline"`
	metav1.ListMeta `json:"metadata,omitempty"`
	Items           []NBDVolume `json:"items"`
}

// NBDStorageNodeStatus is what a storage agent reports about its node.
type NBDStorageNodeStatus struct {
	// CapacityBytes is the size of the data directory's filesystem.
	CapacityBytes int64 `json:"capacityBytes"`
	// AvailableBytes is what new volumes may still take.
	AvailableBytes int64 `json:"availableBytes"`
	// Addresses are the node's storage addresses (MPTCP signal endpoints).
	// +optional
	Addresses []string `json:"addresses,omitempty"`
	// Port is the NBD server's port.
	Port int32 `json:"port"`
	// Topology are the node's topology labels, for accessibility.
	// +optional
	Topology map[string]string `json:"topology,omitempty"`
	// Heartbeat is when the agent last reported.
	Heartbeat metav1.Time `json:"heartbeat"`
	// Orphans are backing files with no NBDVolume (reported, never deleted).
	// +optional
	Orphans []string `json:"orphans,omitempty"`
	// Snapshots is the number of snapshot files on the node.
	// +optional
	Snapshots int32 `json:"snapshots,omitempty"`
	// SnapshotBytes is the space the snapshots use on their own: their
	// allocated bytes not shared with a volume or another snapshot.
	// +optional
	SnapshotBytes int64 `json:"snapshotBytes,omitempty"`
	// SharedBytes is the volumes' data shared by reflink with snapshots or
	// clones. Overwriting it allocates new blocks (copy on write), so it is
	// reserved out of AvailableBytes.
	// +optional
	SharedBytes int64 `json:"sharedBytes,omitempty"`
	// Conditions: Ready, set by the controller from the agent's lease and
	// heartbeat (an agent that is gone cannot say so itself).
	// +optional
	// +listType=map
	// +listMapKey=type
	Conditions []metav1.Condition `json:"conditions,omitempty"`
}

// Condition types and reasons the controller sets (docs/operations.md).
const (
	// ConditionReady on an NBDStorageNode: its agent reports (lease
	// renewed, heartbeat fresh).
	ConditionReady = "Ready"
	// ConditionReachable on an NBDVolume: the storage node serving it
	// (the primary of a replicated volume) is Ready.
	ConditionReachable = "Reachable"
	// ConditionReplicasInSync on a replicated NBDVolume: every replica
	// holds every acknowledged write.
	ConditionReplicasInSync = "ReplicasInSync"
	// ConditionDegraded on an NBDVolume: a node's data path to it is not
	// connected, or has fewer MPTCP subflows than the storage node has
	// addresses.
	ConditionDegraded = "Degraded"

	ReasonAgentReporting    = "AgentReporting"
	ReasonAgentNotReporting = "AgentNotReporting"
	ReasonHeartbeatStale    = "HeartbeatStale"
	ReasonStorageNodeReady  = "StorageNodeReady"
	ReasonStorageNodeDown   = "StorageNodeNotReady"
	// ReasonStorageNodeDeleted: the storage node serving the volume has
	// no NBDStorageNode and its agent's lease is gone; it is taken as
	// lost for good (docs/operations.md "Runbook: a storage node gone
	// for good").
	ReasonStorageNodeDeleted = "StorageNodeDeleted"
	ReasonAllInSync          = "AllInSync"
	ReasonReplicasOut        = "ReplicasOut"
	ReasonPathsUp            = "AllPathsUp"
	ReasonPathsDown          = "PathsDown"
	ReasonDisconnected       = "Disconnected"
)

// NBDStorageNode is one storage agent's report, named after its node.
// +kubebuilder:object:root=true
// +kubebuilder:resource:scope=Cluster,shortName=nbdnode
// +kubebuilder:subresource:status
// +kubebuilder:printcolumn:name="Ready",type=string,JSONPath=`.status.conditions[?(@.type=="Ready")].status`
// +kubebuilder:printcolumn:name="Reason",type=string,JSONPath=`.status.conditions[?(@.type=="Ready")].reason`,priority=1
// +kubebuilder:printcolumn:name="Available",type=integer,JSONPath=`.status.availableBytes`
// +kubebuilder:printcolumn:name="Capacity",type=integer,JSONPath=`.status.capacityBytes`
// +kubebuilder:printcolumn:name="Snapshots",type=integer,JSONPath=`.status.snapshots`
// +kubebuilder:printcolumn:name="Heartbeat",type=date,JSONPath=`.status.heartbeat`
// +kubebuilder:printcolumn:name="Cordoned",type=boolean,JSONPath=`.spec.unschedulable`
// +kubebuilder:printcolumn:name="Draining",type=boolean,JSONPath=`.spec.drain`
type NBDStorageNode struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata,omitempty"`

	// Spec is what an administrator asks of the node (mpnbdctl cordon,
	// drain); its agent never changes it.
	// +optional
	Spec   NBDStorageNodeSpec   `json:"spec,omitempty"`
	Status NBDStorageNodeStatus `json:"status,omitempty"`
}

// NBDStorageNodeSpec is the maintenance asked of a storage node
// (docs/replication.md, "Storage-node maintenance").
type NBDStorageNodeSpec struct {
	// Unschedulable (cordoned): no new volume, and no new replica, is
	// placed on the node; what it holds stays and is served.
	// +optional
	Unschedulable bool `json:"unschedulable,omitempty"`
	// Drain moves every replica of a replicated volume off the node, a
	// new copy made in sync elsewhere before the node's is dropped, the
	// primary handed to an in-sync replica first; the node then holds no
	// replicated volume. It implies Unschedulable.
	// +optional
	Drain bool `json:"drain,omitempty"`
}

// Schedulable reports whether new volumes and replicas may be placed on
// the node (neither cordoned nor draining).
func (n *NBDStorageNode) Schedulable() bool { return !n.Spec.Unschedulable && !n.Spec.Drain }

// NBDStorageNodeList is a list of NBDStorageNode.
// +kubebuilder:object:root=true
type NBDStorageNodeList struct {
	metav1.TypeMeta `json:",inline"`
	metav1.ListMeta `json:"metadata,omitempty"`
	Items           []NBDStorageNode `json:"items"`
}

func init() {
	SchemeBuilder.Register(&NBDVolume{}, &NBDVolumeList{}, &NBDStorageNode{}, &NBDStorageNodeList{})
}
