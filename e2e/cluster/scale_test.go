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
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"sigs.k8s.io/yaml"

	"github.com/mpnbd/mpnbd/e2e/bench"
	"github.com/mpnbd/mpnbd/internal/testenv/repo"
)

// envScale lists the numbers of PVCs the scale scenario creates at once
// ("10,25,50,100"; make soak sets it); without it the scenario is
// skipped.
const envScale = "MPNBD_CLUSTER_SCALE"

// envScaleOnly, set to anything, runs the scale scenario right after the
// upgrade to this chart and the issuing of the node's certificates, and
// uninstalls the driver (the other scenarios are skipped).
const envScaleOnly = "MPNBD_CLUSTER_SCALE_ONLY"

// claimsPerPod is how many of the scale scenario's claims one pod mounts.
const claimsPerPod = 10

// scaleStep is what one count of volumes took.
type scaleStep struct {
	Volumes int `json:"volumes"`
	// Bound: from the PVCs' creation until every one is Bound (the
	// class binds at once: provisioning alone). Mounted: from the pods'
	// creation until every pod runs (attach, stage, publish). Released:
	// from the pods' deletion until no VolumeAttachment of the step is
	// left (unpublish, unstage, detach). Deleted: from the PVCs' deletion
	// until their PersistentVolumes and NBDVolumes are gone.
	BoundSeconds    float64 `json:"bound_seconds"`
	MountedSeconds  float64 `json:"mounted_seconds"`
	ReleasedSeconds float64 `json:"released_seconds"`
	DeletedSeconds  float64 `json:"deleted_seconds"`
	// Resident memory (cgroup total_rss) of the driver's pods with every
	// volume of the step mounted, MiB.
	NodeMiB       float64 `json:"node_plugin_mib"`
	DatapathMiB   float64 `json:"datapath_mib"`
	AgentMiB      float64 `json:"storage_agent_mib"`
	ControllerMiB float64 `json:"controller_mib"`
}

// parseScale reads envScale's list: positive counts, ascending.
func parseScale(v string) ([]int, error) {
	var counts []int
	for _, f := range strings.Split(v, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || n <= 0 {
			return nil, fmt.Errorf("%s=%q: %q is not a positive count", envScale, v, f)
		}
		if len(counts) > 0 && n <= counts[len(counts)-1] {
			return nil, fmt.Errorf("%s=%q: counts must ascend", envScale, v)
		}
		counts = append(counts, n)
	}
	return counts, nil
}

// scalePod mounts claims at /data0, /data1, ...; it writes a file to
// each, reads it back, prints how many it checked and keeps running.
func scalePod(name string, claims []string) string {
	var mounts, vols []string
	for i, c := range claims {
		mounts = append(mounts, fmt.Sprintf("{name: v%d, mountPath: /data%d}", i, i))
		vols = append(vols, fmt.Sprintf("{name: v%d, persistentVolumeClaim: {claimName: %s}}", i, c))
	}
	script := `n=0; for d in /data*; do echo "$d" > "$d/id" && sync && [ "$(cat "$d/id")" = "$d" ] && n=$((n+1)); done; echo checked=$n; sleep 3600`
	return podSpec(name, `labels: {mpnbd.io/scale: "true"}`, script,
		"volumeMounts: ["+strings.Join(mounts, ", ")+"]", strings.Join(vols, ", "))
}

// scaleScenario creates N PVCs at once for each N of envScale, mounts
// them all (claimsPerPod to a pod), and deletes them, timing each phase
// and reading the driver's memory with all N mounted. It writes the
// curves to out/cluster-scale.json and out/cluster-scale.svg.
func (s *suite) scaleScenario() {
	t := s.t
	v := os.Getenv(envScale)
	if v == "" {
		t.Logf("scale scenario skipped: %s is not set (make soak sets it)", envScale)
		return
	}
	counts, err := parseScale(v)
	if err != nil {
		t.Fatal(err)
	}
	s.apply(fuseClass("mpnbd-scale", "required", "Immediate", "csi.storage.k8s.io/fstype: ext4"))
	var steps []scaleStep
	for _, n := range counts {
		steps = append(steps, s.scaleStep(n))
	}
	s.kubectl("delete", "storageclass", "mpnbd-scale")

	var b strings.Builder
	fmt.Fprintf(&b, "%8s %10s %10s %10s %10s %10s %10s %10s %10s\n", "volumes", "bound s", "mounted s", "released s", "deleted s",
		"node MiB", "datapath", "agent", "controller")
	for _, st := range steps {
		fmt.Fprintf(&b, "%8d %10.1f %10.1f %10.1f %10.1f %10.1f %10.1f %10.1f %10.1f\n", st.Volumes, st.BoundSeconds, st.MountedSeconds,
			st.ReleasedSeconds, st.DeletedSeconds, st.NodeMiB, st.DatapathMiB, st.AgentMiB, st.ControllerMiB)
	}
	t.Logf("scale: PVCs created at once on one node (fuse, TLS, ext4):\n%s", b.String())
	if err := writeScale(steps); err != nil {
		t.Errorf("writing the scale report: %v", err)
	}
}

// scaleStep runs one count of volumes through its whole life.
func (s *suite) scaleStep(n int) scaleStep {
	t := s.t
	st := scaleStep{Volumes: n}
	label := "mpnbd.io/scale=" + strconv.Itoa(n)
	var claims []string
	var pvcs strings.Builder
	for i := range n {
		name := fmt.Sprintf("scale-%d-%d", n, i)
		claims = append(claims, name)
		fmt.Fprintf(&pvcs, "---\n%s", strings.Replace(pvc(name, "mpnbd-scale", "64Mi", false),
			"namespace: default}", fmt.Sprintf("namespace: default, labels: {mpnbd.io/scale: %q}}", strconv.Itoa(n)), 1))
	}
	// Bounds, generous for a 2-core node: none of them is a goal.
	bound := 2*time.Minute + time.Duration(n)*3*time.Second
	count := func(jsonpath string, args ...string) (int, []string) {
		f := strings.Fields(s.jsonpath(jsonpath, args...))
		return len(f), f
	}
	s.step(fmt.Sprintf("scale %d: PVCs bound", n), func() {
		start := time.Now()
		s.apply(pvcs.String())
		s.waitFor(fmt.Sprintf("%d claims bound", n), bound, func() string {
			_, phases := count("{.items[*].status.phase}", "get", "pvc", "-l", label)
			if b := strings.Count(strings.Join(phases, " "), "Bound"); b < n {
				return fmt.Sprintf("%d of %d bound", b, n)
			}
			return ""
		})
		st.BoundSeconds = time.Since(start).Seconds()
	})
	var pods []string
	s.step(fmt.Sprintf("scale %d: every claim mounted in a pod", n), func() {
		start := time.Now()
		var manifests strings.Builder
		for i := 0; i < n; i += claimsPerPod {
			name := fmt.Sprintf("scale-%d-pod-%d", n, i/claimsPerPod)
			pods = append(pods, name)
			fmt.Fprintf(&manifests, "---\n%s", scalePod(name, claims[i:min(i+claimsPerPod, n)]))
		}
		s.apply(manifests.String())
		s.waitFor(fmt.Sprintf("%d pods running", len(pods)), bound, func() string {
			_, phases := count("{.items[*].status.phase}", "get", "pod", "-l", "mpnbd.io/scale=true")
			if r := strings.Count(strings.Join(phases, " "), "Running"); r < len(pods) {
				return fmt.Sprintf("%d of %d pods running", r, len(pods))
			}
			return ""
		})
		st.MountedSeconds = time.Since(start).Seconds()
		checked := 0
		for i, p := range pods {
			want := min(claimsPerPod, n-i*claimsPerPod)
			s.waitFor("pod "+p+" checking its volumes", time.Minute, func() string {
				out := s.kubectl("logs", p)
				if field(out, "checked") == "" {
					return "no result yet"
				}
				if got := field(out, "checked"); got != strconv.Itoa(want) {
					t.Fatalf("pod %s wrote and read back %s of its %d volumes", p, got, want)
				}
				return ""
			})
			checked += want
		}
		if checked != n {
			t.Fatalf("%d volumes checked, want %d", checked, n)
		}
		uses, err := s.resourceUse()
		if err != nil {
			t.Fatalf("reading the driver's memory: %v", err)
		}
		for _, u := range uses {
			mib := float64(u.rssBytes) / (1 << 20)
			switch {
			case strings.HasPrefix(u.pod, "mpnbd-node-"):
				st.NodeMiB += mib
			case strings.HasPrefix(u.pod, "mpnbd-datapath-"):
				st.DatapathMiB += mib
			case strings.HasPrefix(u.pod, "mpnbd-storage-agent-"):
				st.AgentMiB += mib
			case strings.HasPrefix(u.pod, "mpnbd-controller-"):
				st.ControllerMiB += mib
			}
		}
		if st.NodeMiB == 0 || st.DatapathMiB == 0 || st.AgentMiB == 0 || st.ControllerMiB == 0 {
			t.Errorf("memory of a driver pod not found: %+v", st)
		}
	})
	var pvs []string
	s.step(fmt.Sprintf("scale %d: pods deleted, volumes detached", n), func() {
		_, pvs = count("{.items[*].spec.volumeName}", "get", "pvc", "-l", label)
		if len(pvs) != n {
			t.Fatalf("%d volumes for %d claims", len(pvs), n)
		}
		start := time.Now()
		s.kubectl("delete", "pod", "-l", "mpnbd.io/scale=true", "--wait=false")
		s.waitFor("the step's volume attachments to go", bound, func() string {
			_, attached := count("{.items[*].spec.source.persistentVolumeName}", "get", "volumeattachments")
			if left := among(pvs, attached); left > 0 {
				return fmt.Sprintf("%d of %d still attached", left, n)
			}
			if p, _ := count("{.items[*].metadata.name}", "get", "pod", "-l", "mpnbd.io/scale=true"); p > 0 {
				return fmt.Sprintf("%d pods left", p)
			}
			return ""
		})
		st.ReleasedSeconds = time.Since(start).Seconds()
	})
	s.step(fmt.Sprintf("scale %d: claims deleted, volumes gone", n), func() {
		start := time.Now()
		s.kubectl("delete", "pvc", "-l", label, "--wait=false")
		s.waitFor("the step's volumes to go", bound, func() string {
			_, allPVs := count("{.items[*].metadata.name}", "get", "pv")
			_, allVols := count("{.items[*].metadata.name}", "get", "nbdvolumes")
			if left := among(pvs, append(allPVs, allVols...)); left > 0 {
				return fmt.Sprintf("%d of %d volumes left", left, n)
			}
			return ""
		})
		st.DeletedSeconds = time.Since(start).Seconds()
	})
	return st
}

// among counts the names that are in list.
func among(names, list []string) int {
	n := 0
	for _, name := range names {
		if slices.Contains(list, name) {
			n++
		}
	}
	return n
}

// writeScale writes the steps as JSON and as a chart of the times
// against the number of volumes into the repository's out/.
func writeScale(steps []scaleStep) error {
	root, err := repo.Root()
	if err != nil {
		return err
	}
	dir := filepath.Join(root, "out")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	js, err := json.MarshalIndent(steps, "", "  ")
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, "cluster-scale.json"), append(js, '\n'), 0o644); err != nil {
		return err
	}
	c := bench.LineChart{
		Title:    "PVCs created at once on one node: time until all are ...",
		Subtitle: "single-node cluster, fuse transport over TLS, ext4, 64 MiB each, 10 claims per pod",
		XLabel:   "PVCs at once", YLabel: "seconds",
		Series: []bench.ChartSeries{
			{Name: "bound", Color: "#1f6fb2", Labels: true},
			{Name: "mounted", Color: "#27ae60", Labels: true},
			{Name: "detached", Color: "#8e44ad"},
			{Name: "deleted", Color: "#e67e22"},
		},
	}
	for _, st := range steps {
		c.X = append(c.X, strconv.Itoa(st.Volumes))
		for i, v := range []float64{st.BoundSeconds, st.MountedSeconds, st.ReleasedSeconds, st.DeletedSeconds} {
			c.Series[i].Y = append(c.Series[i].Y, v)
		}
	}
	return os.WriteFile(filepath.Join(dir, "cluster-scale.svg"), []byte(c.SVG()), 0o644)
}

func TestParseScale(t *testing.T) {
	got, err := parseScale("10, 25,100")
	if err != nil || fmt.Sprint(got) != "[10 25 100]" {
		t.Errorf("parseScale: %v, %v", got, err)
	}
	for _, bad := range []string{"", "10,,20", "0", "-5", "25,10", "10,10", "x"} {
		if _, err := parseScale(bad); err == nil {
			t.Errorf("%q accepted", bad)
		}
	}
}

func TestScalePod(t *testing.T) {
	m := scalePod("p", []string{"a", "b"})
	for _, want := range []string{"claimName: a}", "claimName: b}", "mountPath: /data1}", "name: p,", "checked="} {
		if !strings.Contains(m, want) {
			t.Errorf("manifest lacks %q:\n%s", want, m)
		}
	}
	var obj map[string]any
	if err := yaml.Unmarshal([]byte(m), &obj); err != nil {
		t.Fatalf("not YAML: %v\n%s", err, m)
	}
}
