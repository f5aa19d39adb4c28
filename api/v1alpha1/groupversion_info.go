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

// Package v1alpha1 holds the custom resources that are the contract
// between the controller, the storage agents and the node plugins.
// +kubebuilder:object:generate=true
// +groupName=mpnbd.io
package v1alpha1

import (
	"fmt"
	"strings"

	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/util/validation"
	"sigs.k8s.io/controller-runtime/pkg/scheme"
)

var (
	// GroupVersion is the API group and version of these resources.
	GroupVersion = schema.GroupVersion{Group: "mpnbd.io", Version: "v1alpha1"}
	// SchemeBuilder registers the types with a scheme.
	SchemeBuilder = &scheme.Builder{GroupVersion: GroupVersion}
	// AddToScheme adds the types to a scheme.
	AddToScheme = SchemeBuilder.AddToScheme
)

// Finalizer keeps a volume until its storage agent removed the backing store.
const Finalizer = "mpnbd.io/backing-store"

// replicaPrefix begins the label that marks the volumes of which a
// storage node holds a replica, and that node's finalizer on them.
const replicaPrefix = "replica.mpnbd.io/"

// ReplicaLabel is the label the controller puts on a replicated volume
// for each node of its spec.replicaNodes: the agent of that node watches
// the volumes that carry it. A node whose name is longer than a label's
// name may hold (63 characters) holds no replica (ValidReplicaNode).
func ReplicaLabel(node string) string { return replicaPrefix + node }

// ReplicaFinalizer keeps a replicated volume until the agent of node, one
// of its spec.replicaNodes, has closed (and, as for Finalizer, deleted)
// its copy. It is the same string as ReplicaLabel.
func ReplicaFinalizer(node string) string { return replicaPrefix + node }

// ValidReplicaNode reports why node cannot hold a replica (its name does
// not fit the name of ReplicaLabel), or nil.
func ValidReplicaNode(node string) error {
	if errs := validation.IsQualifiedName(ReplicaLabel(node)); len(errs) > 0 {
		return fmt.Errorf("storage node %q cannot hold a replica: its name makes no label name: %s", node, strings.Join(errs, "; "))
	}
	return nil
}

// DeleteDataAnnotation, set to DeleteDataTrue on an NBDVolume, asks its
// storage agent to delete the backing file once the object is deleted. The
// controller sets it in CSI DeleteVolume, just before it deletes the
// object (or on an object someone else deleted already). An NBDVolume
// deleted without it (kubectl delete, or deleting the CRD) keeps its data:
// the agent closes the export, keeps the file, releases the finalizer, and
// reports the file in its NBDStorageNode's status.orphans. Either way the
// volume stays while it is published (condition DeletionBlocked).
const (
	DeleteDataAnnotation = "mpnbd.io/delete-data"
	DeleteDataTrue       = "true"
)

// DeletesData reports whether deleting v deletes its backing file
// (DeleteDataAnnotation).
func (v *NBDVolume) DeletesData() bool {
	return v.Annotations[DeleteDataAnnotation] == DeleteDataTrue
}

// StorageLeaseName is the coordination.k8s.io Lease, in the driver's
// namespace, that the storage agent of node renews while it runs: the
// controller fails a replicated volume over from a primary whose lease
// it has not seen renewed for the lease's duration.
func StorageLeaseName(node string) string { return "mpnbd-storage-" + node }
