package driver

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	"sigs.k8s.io/controller-runtime/pkg/client"
	ctrlconfig "sigs.k8s.io/controller-runtime/pkg/client/config"

	"github.com/mpnbd/mpnbd/pkg/access"
)

// KubeConfig loads the API server configuration: from path when set,
// else by controller-runtime's lookup ($KUBECONFIG, in-cluster,
// ~/.kube/config).
func KubeConfig(path string) (*rest.Config, error) {
	if path == "" {
		return ctrlconfig.GetConfig()
	}
	c, err := clientcmd.BuildConfigFromFlags("", path)
	if err != nil {
		return nil, fmt.Errorf("kubeconfig %s: %w", path, err)
	}
	return c, nil
}

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
