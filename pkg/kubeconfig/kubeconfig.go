// Package kubeconfig loads the API server configuration of the driver's
// commands and the test cluster's tools.
package kubeconfig

import (
	"fmt"

	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	ctrlconfig "sigs.k8s.io/controller-runtime/pkg/client/config"
)

// Load returns the configuration in the kubeconfig file at path when path
// is set, else controller-runtime's lookup ($KUBECONFIG, in-cluster,
// ~/.kube/config).
func Load(path string) (*rest.Config, error) {
	if path == "" {
		return ctrlconfig.GetConfig()
	}
	c, err := clientcmd.BuildConfigFromFlags("", path)
	if err != nil {
		return nil, fmt.Errorf("kubeconfig %s: %w", path, err)
	}
	return c, nil
}
