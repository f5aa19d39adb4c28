package main

import (
	"context"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes/fake"
	"k8s.io/utils/ptr"
)

func TestOwnerErrors(t *testing.T) {
	ctx := context.Background()
	if o, err := owner(ctx, fake.NewClientset(), "ns", "p", -1); o != nil || err != nil {
		t.Errorf("level -1: %v %v", o, err)
	}
	if _, err := owner(ctx, fake.NewClientset(), "ns", "missing", 1); err == nil {
		t.Error("missing pod: no error")
	}
	orphan := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "p", Namespace: "ns", UID: "u1"}}
	kube := fake.NewClientset(orphan)
	if o, err := owner(ctx, kube, "ns", "p", 0); err != nil || o.Kind != "Pod" || o.UID != "u1" || !*o.Controller {
		t.Errorf("level 0: %+v %v", o, err)
	}
	if _, err := owner(ctx, kube, "ns", "p", 1); err == nil {
		t.Error("pod without controller: no error")
	}
	// A ReplicaSet that is not there cannot be looked above.
	owned := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "q", Namespace: "ns", OwnerReferences: []metav1.OwnerReference{{
		APIVersion: "apps/v1", Kind: "ReplicaSet", Name: "rs", UID: types.UID("rs1"), Controller: ptr.To(true),
	}}}}
	kube = fake.NewClientset(owned)
	if o, err := owner(ctx, kube, "ns", "q", 1); err != nil || o.Kind != "ReplicaSet" || o.UID != "rs1" {
		t.Errorf("level 1: %+v %v", o, err)
	}
	if _, err := owner(ctx, kube, "ns", "q", 2); err == nil {
		t.Error("missing ReplicaSet: no error")
	}
}
