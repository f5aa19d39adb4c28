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

// Package apiserver runs a real kube-apiserver (with etcd) for tests, via
// controller-runtime's envtest, with the project's CRDs installed.
//
// The binaries come from hack/test-apiserver.sh (etcd from Debian,
// kube-apiserver built and cached by hack/kube-binaries.sh). When they
// cannot be had, or the test is not running as root on Linux, Start skips
// the test, unless MPNBD_APISERVER_REQUIRE=1, in which case it fails it.
package apiserver

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	apiruntime "k8s.io/apimachinery/pkg/runtime"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/envtest"

	"github.com/mpnbd/mpnbd/api/v1alpha1"
	"github.com/mpnbd/mpnbd/internal/testenv/repo"
)

// RequireEnv makes an unavailable API server a failure instead of a skip.
const RequireEnv = "MPNBD_APISERVER_REQUIRE"

var (
	assetsOnce sync.Once
	assetsDir  string
	assetsErr  error
)

// Scheme returns a scheme with the built-in types, CustomResourceDefinition
// and api/v1alpha1.
func Scheme() (*apiruntime.Scheme, error) {
	s := apiruntime.NewScheme()
	if err := clientgoscheme.AddToScheme(s); err != nil {
		return nil, err
	}
	if err := apiextensionsv1.AddToScheme(s); err != nil {
		return nil, err
	}
	if err := v1alpha1.AddToScheme(s); err != nil {
		return nil, err
	}
	return s, nil
}

// unavailable skips t, or fails it when RequireEnv is set.
func unavailable(t testing.TB, format string, args ...any) {
	t.Helper()
	msg := fmt.Sprintf(format, args...)
	if os.Getenv(RequireEnv) == "1" {
		t.Fatalf("API server required (%s=1) but unavailable: %s", RequireEnv, msg)
	}
	fmt.Fprintf(os.Stderr, "apiserver: skipping: %s\n", msg)
	t.Skip(msg)
}

// assets runs hack/test-apiserver.sh once per process and returns the
// KUBEBUILDER_ASSETS directory it prints.
func assets(root string) (string, error) {
	assetsOnce.Do(func() {
		cmd := exec.Command(filepath.Join(root, "hack", "test-apiserver.sh"))
		cmd.Dir = root
		var stdout, stderr bytes.Buffer
		cmd.Stdout = &stdout
		cmd.Stderr = &stderr
		if err := cmd.Run(); err != nil {
			assetsErr = fmt.Errorf("hack/test-apiserver.sh: %w: %s", err, strings.TrimSpace(stderr.String()))
			return
		}
		sc := bufio.NewScanner(&stdout)
		for sc.Scan() {
			if v, ok := strings.CutPrefix(sc.Text(), "KUBEBUILDER_ASSETS="); ok {
				assetsDir = v
			}
		}
		if assetsDir == "" {
			assetsErr = fmt.Errorf("hack/test-apiserver.sh printed no KUBEBUILDER_ASSETS: %q", stdout.String())
		}
	})
	return assetsDir, assetsErr
}

// ErrUnavailable marks a StartEnv failure that means the API server
// cannot be had on this machine (wrong OS, not root, binaries missing),
// as opposed to one that failed to start.
var ErrUnavailable = errors.New("test API server unavailable")

// StartEnv runs etcd and kube-apiserver with the CRDs of deploy/crds
// installed and returns a config and a client (whose scheme knows
// api/v1alpha1) for it, and stop, which stops both. It is for commands;
// tests use Start. Errors wrapping ErrUnavailable mean the machine cannot
// run it.
func StartEnv() (cfg *rest.Config, c client.Client, stop func() error, err error) {
	if runtime.GOOS != "linux" {
		return nil, nil, nil, fmt.Errorf("%w: needs linux, running on %s", ErrUnavailable, runtime.GOOS)
	}
	if os.Geteuid() != 0 {
		return nil, nil, nil, fmt.Errorf("%w: needs root (to install etcd and use the shared binary cache)", ErrUnavailable)
	}
	root, err := repo.Root()
	if err != nil {
		return nil, nil, nil, err
	}
	dir, err := assets(root)
	if err != nil {
		return nil, nil, nil, fmt.Errorf("%w: %v", ErrUnavailable, err)
	}
	for _, b := range []string{"etcd", "kube-apiserver"} {
		if _, err := os.Stat(filepath.Join(dir, b)); err != nil {
			return nil, nil, nil, fmt.Errorf("%w: %v", ErrUnavailable, err)
		}
	}
	scheme, err := Scheme()
	if err != nil {
		return nil, nil, nil, err
	}
	env := &envtest.Environment{
		BinaryAssetsDirectory: dir,
		CRDDirectoryPaths:     []string{filepath.Join(root, "deploy", "crds")},
		ErrorIfCRDPathMissing: true,
		Scheme:                scheme,
	}
	// A graceful stop takes seconds after a suite whose clients were
	// killed mid-request, more on a loaded machine; the default 20 s
	// fails a test that passed.
	env.ControlPlane.GetAPIServer().StopTimeout = time.Minute
	cfg, err = env.Start()
	if err != nil {
		// The binaries are there; a failure to start is a real failure.
		return nil, nil, nil, fmt.Errorf("starting the test API server: %w", err)
	}
	stop = func() error {
		if err := env.Stop(); err != nil {
			return fmt.Errorf("stopping the test API server: %w", err)
		}
		return nil
	}
	fail := func(err error) (*rest.Config, client.Client, func() error, error) {
		return nil, nil, nil, errors.Join(err, stop())
	}
	if len(env.CRDs) != 3 {
		return fail(fmt.Errorf("installed %d CRDs from deploy/crds, want 3", len(env.CRDs)))
	}
	c, err = client.New(cfg, client.Options{Scheme: scheme})
	if err != nil {
		return fail(err)
	}
	return cfg, c, stop, nil
}

// Start runs etcd and kube-apiserver with the CRDs of deploy/crds installed
// and returns a config and a client (whose scheme knows api/v1alpha1) for
// it. Both are stopped when t's cleanup runs.
func Start(t testing.TB) (*rest.Config, client.Client) {
	t.Helper()
	cfg, c, stop, err := StartEnv()
	if errors.Is(err, ErrUnavailable) {
		unavailable(t, "%s", strings.TrimPrefix(err.Error(), ErrUnavailable.Error()+": "))
	}
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := stop(); err != nil {
			t.Error(err)
		}
	})
	return cfg, c
}

// WriteKubeconfig stores cfg (a client-certificate or token config, as
// Start returns) as a kubeconfig file in a temporary directory of t.
func WriteKubeconfig(t testing.TB, cfg *rest.Config) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "kubeconfig")
	if err := WriteKubeconfigFile(path, cfg); err != nil {
		t.Fatal(err)
	}
	return path
}

// WriteKubeconfigFile stores cfg (a client-certificate or token config, as
// StartEnv returns, impersonating as As makes it) as a kubeconfig file at
// path.
func WriteKubeconfigFile(path string, cfg *rest.Config) error {
	kc := clientcmdapi.NewConfig()
	kc.Clusters["test"] = &clientcmdapi.Cluster{Server: cfg.Host, CertificateAuthorityData: cfg.CAData}
	kc.AuthInfos["test"] = &clientcmdapi.AuthInfo{
		ClientCertificateData: cfg.CertData, ClientKeyData: cfg.KeyData, Token: cfg.BearerToken,
		// As's impersonation, for a command that acts as a ServiceAccount.
		Impersonate: cfg.Impersonate.UserName, ImpersonateGroups: cfg.Impersonate.Groups, ImpersonateUserExtra: cfg.Impersonate.Extra,
	}
	kc.Contexts["test"] = &clientcmdapi.Context{Cluster: "test", AuthInfo: "test"}
	kc.CurrentContext = "test"
	return clientcmd.WriteToFile(*kc, path)
}

// Apply creates every object of the YAML files (paths relative to the
// repository root) that does not exist yet, and their namespaces: the deploy tree's RBAC, for a
// test that acts as the driver's ServiceAccounts (see As).
func Apply(ctx context.Context, c client.Client, paths ...string) error {
	root, err := repo.Root()
	if err != nil {
		return err
	}
	for _, p := range paths {
		f, err := os.Open(filepath.Join(root, p))
		if err != nil {
			return err
		}
		dec := utilyaml.NewYAMLOrJSONDecoder(f, 4096)
		for {
			var u unstructured.Unstructured
			err := dec.Decode(&u.Object)
			if errors.Is(err, io.EOF) {
				break
			}
			if err != nil {
				f.Close()
				return fmt.Errorf("%s: %w", p, err)
			}
			if len(u.Object) == 0 {
				continue
			}
			if ns := u.GetNamespace(); ns != "" {
				n := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}
				if err := c.Create(ctx, n); err != nil && !apierrors.IsAlreadyExists(err) {
					f.Close()
					return fmt.Errorf("%s: namespace %s: %w", p, ns, err)
				}
			}
			if err := c.Create(ctx, &u); err != nil && !apierrors.IsAlreadyExists(err) {
				f.Close()
				return fmt.Errorf("%s: %s %s: %w", p, u.GetKind(), u.GetName(), err)
			}
		}
		f.Close()
	}
	return nil
}

// DeployNamespace is the namespace of the deploy tree's ServiceAccounts.
const DeployNamespace = "mpnbd-system"

// As returns a copy of cfg that acts as the deploy tree's ServiceAccount
// name (mpnbd-storage-agent, say), holding a token bound to a pod on node
// when node is not empty, as the kubelet's tokens are. Apply its RBAC
// first.
func As(cfg *rest.Config, name, node string) *rest.Config {
	ic := rest.CopyConfig(cfg)
	ic.Impersonate = rest.ImpersonationConfig{
		UserName: "system:serviceaccount:" + DeployNamespace + ":" + name,
		Groups:   []string{"system:serviceaccounts", "system:serviceaccounts:" + DeployNamespace, "system:authenticated"},
	}
	if node != "" {
		ic.Impersonate.Extra = map[string][]string{"authentication.kubernetes.io/node-name": {node}}
	}
	return ic
}
