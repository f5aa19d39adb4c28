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
	"encoding/json"
	"fmt"
	"strings"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/mpnbd/mpnbd/pkg/access"
)

// PublishStorageAddresses records a node's storage IP addresses in the
// annotation of its Node object that ControllerPublishVolume reads.
func PublishStorageAddresses(ctx context.Context, c client.Client, nodeID string, addrs []string) error {
	return annotateNode(ctx, c, nodeID, map[string]string{access.AnnotationStorageAddresses: strings.Join(addrs, ",")})
}

// PublishNodeAccess records on a node's Node object what
// ControllerPublishVolume copies into the publications to it: its
// storage IP addresses and the hash of its token (access.TokenHash).
func PublishNodeAccess(ctx context.Context, c client.Client, nodeID string, addrs []string, tokenHash string) error {
	return annotateNode(ctx, c, nodeID, map[string]string{
		access.AnnotationStorageAddresses: strings.Join(addrs, ","),
		access.AnnotationTokenSHA256:      tokenHash,
	})
}

func annotateNode(ctx context.Context, c client.Client, nodeID string, annotations map[string]string) error {
	patch, err := json.Marshal(map[string]any{"metadata": map[string]any{"annotations": annotations}})
	if err != nil {
		return err
	}
	node := &corev1.Node{}
	node.Name = nodeID
	if err := c.Patch(ctx, node, client.RawPatch(types.MergePatchType, patch)); err != nil {
		return fmt.Errorf("annotate node %s with its storage addresses: %w", nodeID, err)
	}
	return nil
}
