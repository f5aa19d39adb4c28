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
	patch, err := json.Marshal(map[string]any{"metadata": map[string]any{
		"annotations": map[string]string{access.AnnotationStorageAddresses: strings.Join(addrs, ",")},
	}})
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
