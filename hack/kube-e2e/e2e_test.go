//go:build kube_e2e

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

// Package kubee2e is the main of an e2e.test that holds only Kubernetes'
// storage suites for external CSI drivers (External.Storage, defined from
// -storage.testdriver files). hack/kube-e2e.sh builds it in a module of its
// own, against the pinned k8s.io/kubernetes; the build tag keeps it out of
// the driver's module, which does not require Kubernetes' test code.
package kubee2e

import (
	"context"
	"flag"
	"fmt"
	"os"
	"testing"

	"github.com/onsi/ginkgo/v2"
	"github.com/onsi/gomega"

	"k8s.io/component-base/logs"
	"k8s.io/component-base/version"
	"k8s.io/klog/v2"
	"k8s.io/kubernetes/test/e2e/framework"
	"k8s.io/kubernetes/test/e2e/framework/config"
	e2enode "k8s.io/kubernetes/test/e2e/framework/node"
	"k8s.io/kubernetes/test/e2e/framework/testfiles"
	e2etestingmanifests "k8s.io/kubernetes/test/e2e/testing-manifests"

	// Feature names: the set is frozen once the storage suites added theirs.
	_ "k8s.io/kubernetes/test/e2e/feature"
	// The suites: -storage.testdriver defines them for each driver file.
	_ "k8s.io/kubernetes/test/e2e/storage/external"

	// What the framework does on failure (namespace dumps), metrics
	// gathering and node checks, as in the full e2e.test.
	_ "k8s.io/kubernetes/test/e2e/framework/debug/init"
	_ "k8s.io/kubernetes/test/e2e/framework/metrics/init"
	_ "k8s.io/kubernetes/test/e2e/framework/node/init"
	_ "k8s.io/kubernetes/test/utils/format"

	// The logging flags (-v and friends).
	_ "k8s.io/component-base/logs/testinit"
)

func TestMain(m *testing.M) {
	showVersion := flag.Bool("version", false, "Print the Kubernetes version the suites are from and exit.")
	config.CopyFlags(config.Flags, flag.CommandLine)
	framework.RegisterCommonFlags(flag.CommandLine)
	framework.RegisterClusterFlags(flag.CommandLine)
	flag.Parse()
	if *showVersion {
		fmt.Println(version.Get())
		os.Exit(0)
	}
	if flag.NArg() > 0 {
		fmt.Fprintf(os.Stderr, "unknown arguments: %q\n", flag.Args())
		os.Exit(2)
	}
	// A driver file names its StorageClass file relative to -repo-root
	// (or absolutely); Kubernetes' own manifests come embedded.
	if framework.TestContext.RepoRoot != "" {
		testfiles.AddFileSource(testfiles.RootFileSource{Root: framework.TestContext.RepoRoot})
	}
	testfiles.AddFileSource(e2etestingmanifests.GetE2ETestingManifestsFS())
	framework.AfterReadingAllFlags(&framework.TestContext)
	os.Exit(m.Run())
}

func TestE2E(t *testing.T) {
	logs.InitLogs()
	defer logs.FlushLogs()
	klog.EnableContextualLogging(true)
	gomega.RegisterFailHandler(framework.Fail)
	suiteConfig, reporterConfig := framework.CreateGinkgoConfig()
	klog.Infof("e2e run %q on Ginkgo process %d", framework.RunID, suiteConfig.ParallelProcess)
	ginkgo.RunSpecs(t, "Kubernetes storage e2e suite (External.Storage)", suiteConfig, reporterConfig)
}

// Once, before any spec: every node schedulable, and the node count known
// to the specs that need several (multi-node access, topology).
var _ = ginkgo.SynchronizedBeforeSuite(func(ctx context.Context) []byte {
	c, err := framework.LoadClientset()
	framework.ExpectNoError(err, "loading the client")
	timeouts := framework.NewTimeoutContext()
	framework.ExpectNoError(e2enode.WaitForAllNodesSchedulable(ctx, c, timeouts.NodeSchedulable))
	if sv, err := c.Discovery().ServerVersion(); err == nil {
		framework.Logf("e2e suites %s, kube-apiserver %s", version.Get().GitVersion, sv.GitVersion)
	}
	return nil
}, func(ctx context.Context, _ []byte) {
	// On every Ginkgo process: the framework's node count.
	if framework.TestContext.CloudConfig.NumNodes != framework.DefaultNumNodes {
		return
	}
	c, err := framework.LoadClientset()
	framework.ExpectNoError(err, "loading the client")
	nodes, err := e2enode.GetReadySchedulableNodes(ctx, c)
	framework.ExpectNoError(err)
	framework.TestContext.CloudConfig.NumNodes = len(nodes.Items)
})
