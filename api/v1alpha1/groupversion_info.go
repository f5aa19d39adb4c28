// Package v1alpha1 holds the custom resources that are the contract
// between the controller, the storage agents and the node plugins.
// +kubebuilder:object:generate=true
// +groupName=mpnbd.io
package v1alpha1

import (
	"k8s.io/apimachinery/pkg/runtime/schema"
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
