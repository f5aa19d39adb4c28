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

// SnapshotFinalizer keeps a snapshot until its storage agent removed the
// snapshot's file.
const SnapshotFinalizer = "mpnbd.io/snapshot-file"

// NBDSnapshotSpec is what the controller asks of the source volume's
// storage agent.
type NBDSnapshotSpec struct {
	// SourceVolume is the NBDVolume (the CSI volume ID) the snapshot is
	// taken of.
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=253
	// +kubebuilder:validation:Pattern=`^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$`
	// +kubebuilder:validation:XValidation:rule="self == oldSelf",message="sourceVolume is immutable"
	SourceVolume string `json:"sourceVolume"`
	// StorageNode is the storage node that takes and keeps the snapshot:
	// the source volume's.
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:XValidation:rule="self == oldSelf",message="storageNode is immutable"
	StorageNode string `json:"storageNode"`
}

// NBDSnapshotStatus is what the storage agent reports.
type NBDSnapshotStatus struct {
	// ReadyToUse is true once the snapshot is taken and durable: it holds
	// every write the source acknowledged before CreationTime and none
	// after.
	// +optional
	ReadyToUse bool `json:"readyToUse,omitempty"`
	// SizeBytes is the source's size when the snapshot was taken: the
	// smallest volume it restores to.
	// +optional
	SizeBytes int64 `json:"sizeBytes,omitempty"`
	// UsedBytes is what the snapshot's file takes on the storage node
	// (its allocated blocks; with reflink, shared with the source at
	// first).
	// +optional
	UsedBytes int64 `json:"usedBytes,omitempty"`
	// Method is how it was taken: "reflink" (copy-on-write clone) or
	// "copy" (the source's data copied).
	// +optional
	Method string `json:"method,omitempty"`
	// CreationTime is when the source was held at the snapshot's flush
	// point.
	// +optional
	CreationTime *metav1.Time `json:"creationTime,omitempty"`
	// HeldMilliseconds is how long the source's writes were held for it.
	// +optional
	HeldMilliseconds int64 `json:"heldMilliseconds,omitempty"`
	// Code is a gRPC code name (e.g. NotFound) when the agent failed, so
	// the controller returns the right code.
	// +optional
	Code string `json:"code,omitempty"`
	// +optional
	Message string `json:"message,omitempty"`
}

// NBDSnapshot is one CSI snapshot: a point-in-time copy of an NBDVolume,
// kept as a file on the volume's storage node.
// +kubebuilder:object:root=true
// +kubebuilder:resource:scope=Cluster,shortName=nbdsnap
// +kubebuilder:selectablefield:JSONPath=`.spec.storageNode`
// +kubebuilder:subresource:status
// +kubebuilder:printcolumn:name="Source",type=string,JSONPath=`.spec.sourceVolume`
// +kubebuilder:printcolumn:name="Node",type=string,JSONPath=`.spec.storageNode`
// +kubebuilder:printcolumn:name="Ready",type=boolean,JSONPath=`.status.readyToUse`
// +kubebuilder:printcolumn:name="Size",type=integer,JSONPath=`.status.sizeBytes`
// +kubebuilder:printcolumn:name="Used",type=integer,JSONPath=`.status.usedBytes`,priority=1
// +kubebuilder:printcolumn:name="Method",type=string,JSONPath=`.status.method`,priority=1
// +kubebuilder:printcolumn:name="Age",type=date,JSONPath=`.metadata.creationTimestamp`
type NBDSnapshot struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata,omitempty"`

	Spec   NBDSnapshotSpec   `json:"spec"`
	Status NBDSnapshotStatus `json:"status,omitempty"`
}

// NBDSnapshotList is a list of NBDSnapshot.
// +kubebuilder:object:root=true
type NBDSnapshotList struct {
	metav1.TypeMeta `json:",inline"`
	metav1.ListMeta `json:"metadata,omitempty"`
	Items           []NBDSnapshot `json:"items"`
}

func init() {
	SchemeBuilder.Register(&NBDSnapshot{}, &NBDSnapshotList{})
}
