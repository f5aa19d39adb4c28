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

package driver

import (
	"context"
	"fmt"
	"strconv"
	"strings"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/mpnbd/mpnbd/api/v1alpha1"
	"github.com/mpnbd/mpnbd/pkg/attach"
)

// AttachmentStatus writes this node's entry in the status.attachments of
// a volume's NBDVolume.
type AttachmentStatus interface {
	Apply(ctx context.Context, volumeID string, a v1alpha1.NodeAttachment) error
	Remove(ctx context.Context, volumeID string) error
}

// NodeFieldManager is the server-side-apply field manager of a node's
// plugin: it owns that node's entries in status.attachments and nothing
// else. Field managers are at most 128 bytes long.
func NodeFieldManager(nodeID string) string {
	m := "mpnbd-node/" + nodeID
	return m[:min(len(m), 128)]
}

// KubeAttachmentStatus writes the entry with server-side apply on the
// status subresource under NodeFieldManager: the storage agent's merge
// patches (which name only the fields they change) and the other nodes'
// entries are left alone, and an apply without the entry removes it. A
// volume whose NBDVolume is gone has no entry to write.
type KubeAttachmentStatus struct {
	Client client.Client
	NodeID string
}

func (k *KubeAttachmentStatus) Apply(ctx context.Context, volumeID string, a v1alpha1.NodeAttachment) error {
	a.NodeID = k.NodeID
	entry, err := runtime.DefaultUnstructuredConverter.ToUnstructured(&a)
	if err != nil {
		return err
	}
	return k.apply(ctx, volumeID, map[string]any{"attachments": []any{entry}})
}

func (k *KubeAttachmentStatus) Remove(ctx context.Context, volumeID string) error {
	return k.apply(ctx, volumeID, map[string]any{})
}

func (k *KubeAttachmentStatus) apply(ctx context.Context, volumeID string, status map[string]any) error {
	u := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": v1alpha1.GroupVersion.String(),
		"kind":       "NBDVolume",
		"metadata":   map[string]any{"name": volumeID},
		"status":     status,
	}}
	err := k.Client.Status().Apply(ctx, client.ApplyConfigurationFromUnstructured(u),
		client.FieldOwner(NodeFieldManager(k.NodeID)), client.ForceOwnership)
	if apierrors.IsNotFound(err) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("status of NBDVolume %s: %w", volumeID, err)
	}
	return nil
}

// attachmentEntry is this node's entry for a volume as a look finds it
// (LastUpdateTime is the caller's).
func attachmentEntry(tr attach.Transport, h attach.Health, expected int, known bool) v1alpha1.NodeAttachment {
	a := v1alpha1.NodeAttachment{Transport: string(tr), Connected: h.Connected}
	if h.MPTCP && h.Connected {
		a.Subflows = SubflowsText(h.Subflows, expected, known)
	}
	return a
}

// SubflowsText is each connection's MPTCP subflows against the number
// expected: "4/4" for one connection, "4/4,3/4" for two, "2/?" when the
// expected number is unknown.
func SubflowsText(subflows []int, expected int, known bool) string {
	want := "?"
	if known {
		want = strconv.Itoa(expected)
	}
	parts := make([]string, len(subflows))
	for i, n := range subflows {
		parts[i] = strconv.Itoa(n) + "/" + want
	}
	return strings.Join(parts, ",")
}
