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

package cluster

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"time"

	"github.com/mpnbd/mpnbd/internal/capability"
	"github.com/mpnbd/mpnbd/internal/testenv/repo"
)

// envKubeStorageFocus chooses which of Kubernetes' storage specs for
// external drivers kubeStorageScenario runs: a Ginkgo focus regexp, or
// "all" for every External.Storage spec but the Disruptive, Serial and
// Flaky ones (make soak); unset, the subset below.
const envKubeStorageFocus = "MPNBD_KUBE_STORAGE_FOCUS"

// kubeStorageSubset is what make test runs: on dynamically provisioned
// volumes, one spec or two of each suite that exercises what the driver
// claims (provisioning from a claim and from a snapshot, data kept,
// volume modes, expansion), and a snapshot's life; small enough for CI.
var kubeStorageSubset = `External.Storage.*(\[Testpattern: Dynamic PV[^]]*\].*(` + strings.Join([]string{
	`provisioning should provision storage with pvc data source$`,
	`provisioning should provision storage with snapshot data source \[`,
	`volumes should store data`,
	`volumeMode should fail to use a volume in a pod with mismatched mode`,
	`volumeMode should not mount / map unused volumes in a pod`,
	`volume-expand should resize volume when PVC is edited while pod is using it`,
}, "|") + `)|\[Testpattern: Dynamic Snapshot \(delete policy\)\] snapshottable .* should check snapshot fields)`

// kubeStorageAllLimit bounds a run of every spec (make soak).
const kubeStorageAllLimit = 75 * time.Minute

// kubeStorageSkip are the specs never run here, and why.
var kubeStorageSkip = map[string]string{
	`\[Disruptive\]|\[Serial\]|\[Flaky\]`: "they restart kubelets or need the cluster alone: make soak's business",
	`\[Feature:Windows\]`:                 "Windows nodes",
}

// ginkgoReport is the part of Ginkgo's JSON report read here.
type ginkgoReport struct {
	SpecReports []struct {
		ContainerHierarchyTexts []string
		LeafNodeText            string
		LeafNodeType            string
		State                   string
		RunTime                 time.Duration
		Failure                 struct {
			Message string
		}
	}
}

// kubeStorageScenario runs Kubernetes' own storage e2e suites for
// external CSI drivers (test/e2e/storage/external at the cluster's
// version, hack/kube-e2e.sh) against the installed driver, as described
// by e2e/cluster/testdata/testdriver.yaml, with the test images they use
// built from local files and imported into the node. Every spec that runs
// must pass; the counts and the skip reasons are logged.
func (s *suite) kubeStorageScenario() {
	t := s.t
	s.step("Kubernetes storage suites (External.Storage)", func() {
		root, err := repo.Root()
		if err != nil {
			t.Fatal(err)
		}
		e2eTest := cachedTool(t, "kube-e2e.sh", "E2E_TEST")
		ginkgo := cachedTool(t, "kube-e2e.sh", "GINKGO")
		agnhost := cachedTool(t, "kube-e2e.sh", "AGNHOST")
		images, err := E2EImages(agnhost, s.dir)
		if err != nil {
			t.Fatal(err)
		}
		s.importBuilt(images)

		focus, limit := os.Getenv(envKubeStorageFocus), 35*time.Minute
		switch focus {
		case "":
			focus = kubeStorageSubset
		case "all":
			focus, limit = `External.Storage`, kubeStorageAllLimit
		}
		var skips []string
		for re, why := range kubeStorageSkip {
			t.Logf("skipping %s: %s", re, why)
			skips = append(skips, re)
		}
		if !capability.Has(capability.Bounding, capability.SysResource) {
			// The kernel's online resize of ext4 needs CAP_SYS_RESOURCE,
			// which this host drops from every bounding set: the driver
			// says so (FailedPrecondition), and the spec cannot pass here.
			re := `volume-expand should resize volume when PVC is edited while pod is using it`
			eph := `ephemeral should support expansion of pvcs created for ephemeral pvcs`
			t.Logf("skipping ext4's online growth (%s; %s): this host drops CAP_SYS_RESOURCE, which the kernel's online ext4 resize needs; the default fs is ext4", re, eph)
			skips = append(skips, `Dynamic PV \(default fs\).*`+re, `Dynamic PV \(ext4\).*`+re,
				`Generic Ephemeral-volume \(default fs\).*`+eph, `Generic Ephemeral-volume \(ext4\).*`+eph)
		}
		slices.Sort(skips)
		out := filepath.Join(s.dir, "kube-storage")
		if err := os.MkdirAll(out, 0o755); err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(s.ctx, limit+5*time.Minute)
		defer cancel()
		args := []string{"-p", "--procs=2", "--focus=" + focus, "--skip=" + strings.Join(skips, "|"),
			"--timeout=" + limit.String(), "--output-dir=" + out, "--json-report=report.json", "--no-color",
			e2eTest, "--",
			"-kubeconfig=" + s.c.Kubeconfig,
			"-kubectl-path=" + filepath.Join(KubeBin(), "kubectl"),
			"-repo-root=" + root,
			"-storage.testdriver=" + filepath.Join(root, "e2e", "cluster", "testdata", "testdriver.yaml"),
			"-report-dir=" + out,
		}
		log := filepath.Join(out, "ginkgo.log")
		lf, err := os.Create(log)
		if err != nil {
			t.Fatal(err)
		}
		start := time.Now()
		cmd := exec.CommandContext(ctx, ginkgo, args...)
		cmd.Stdout, cmd.Stderr = lf, lf
		runErr := cmd.Run()
		lf.Close()
		took := time.Since(start).Round(time.Second)
		b, err := os.ReadFile(filepath.Join(out, "report.json"))
		if err != nil {
			logged, _ := os.ReadFile(log)
			t.Fatalf("ginkgo (%v, %s) wrote no report: %v\n%s", runErr, took, err, lastLines(logged, 80))
		}
		var reports []ginkgoReport
		if err := json.Unmarshal(b, &reports); err != nil {
			t.Fatalf("ginkgo's report: %v", err)
		}
		counts := map[string]int{}
		skipped := map[string]int{}
		var failed []string
		for _, r := range reports {
			for _, sr := range r.SpecReports {
				if sr.LeafNodeType != "It" {
					continue
				}
				counts[sr.State]++
				name := strings.Join(append(slices.Clone(sr.ContainerHierarchyTexts), sr.LeafNodeText), " ")
				switch sr.State {
				case "passed":
				case "skipped":
					skipped[skipReason(sr.Failure.Message)]++
				case "pending":
				default:
					failed = append(failed, fmt.Sprintf("%s (%s): %s", name, sr.State, firstLine(strings.TrimSpace(sr.Failure.Message))))
				}
			}
		}
		t.Logf("Kubernetes storage suites in %s: %d passed, %d failed, %d skipped (%s)", took,
			counts["passed"], len(failed), counts["skipped"], focus)
		var reasons []string
		for r, n := range skipped {
			reasons = append(reasons, fmt.Sprintf("%d: %s", n, r))
		}
		slices.Sort(reasons)
		for _, r := range reasons {
			t.Logf("  skipped %s", r)
		}
		for _, f := range failed {
			t.Errorf("failed: %s", f)
		}
		if counts["passed"] == 0 {
			logged, _ := os.ReadFile(log)
			t.Errorf("no spec passed (ginkgo: %v): the focus selects nothing, or everything skipped\n%s", runErr, lastLines(logged, 40))
		}
		if runErr != nil && len(failed) == 0 {
			logged, _ := os.ReadFile(log)
			t.Errorf("ginkgo failed (%v) with no failed spec in its report\n%s", runErr, lastLines(logged, 40))
		}
	})
}

// skipReason groups a skipped spec's message: the first line, without
// the names and numbers that differ between specs.
var reasonNoise = regexp.MustCompile(`\b[0-9a-f-]{8,}\b|\d+`)

func skipReason(msg string) string {
	if msg == "" {
		return "not selected (focus/skip)"
	}
	return reasonNoise.ReplaceAllString(firstLine(strings.TrimSpace(msg)), "N")
}
