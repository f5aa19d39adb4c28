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
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"
)

// containerUse is what one container of the driver used, from its
// cgroup (v1, the kubelet's cgroupfs driver): peak memory, resident
// memory now and CPU time since it started.
type containerUse struct {
	pod, container string
	peakBytes      int64
	rssBytes       int64
	cpu            time.Duration
	age            time.Duration
}

// cgroupDir finds a container's cgroup directory under the hierarchy of
// controller (memory, cpuacct): kubepods[/<qos>]/pod<uid>/<container id>.
func cgroupDir(controller, podUID, containerID string) (string, error) {
	for _, qos := range []string{"", "burstable", "besteffort"} {
		d := filepath.Join("/sys/fs/cgroup", controller, "kubepods", qos, "pod"+podUID, containerID)
		if _, err := os.Stat(d); err == nil {
			return d, nil
		}
	}
	return "", fmt.Errorf("no %s cgroup for container %s of pod %s", controller, containerID, podUID)
}

func readInt(path string) (int64, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0, err
	}
	return strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
}

// statValue reads key's value from a cgroup's memory.stat.
func statValue(path, key string) (int64, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0, err
	}
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, key+" "); ok {
			return strconv.ParseInt(v, 10, 64)
		}
	}
	return 0, fmt.Errorf("%s: no %s", path, key)
}

// resourceUse reads what every container of the driver's pods used so
// far.
func (s *suite) resourceUse() ([]containerUse, error) {
	// Per pod: a line per container (name, ID, start), then one with
	// the pod's name and UID.
	tmpl := `{range .items[*]}{range .status.containerStatuses[*]}{.name}{" "}{.containerID}{" "}{.state.running.startedAt}{"\n"}{end}{"pod "}{.metadata.name}{" "}{.metadata.uid}{"\n"}{end}`
	raw := s.jsonpath(tmpl, "get", "pods", "-n", namespace)
	var uses []containerUse
	var pending []containerUse
	var ids []string
	for _, l := range strings.Split(raw, "\n") {
		f := strings.Fields(l)
		switch {
		case len(f) == 3 && f[0] == "pod":
			for i := range pending {
				pending[i].pod = f[1]
				id := strings.TrimPrefix(ids[i], "containerd://")
				mem, err := cgroupDir("memory", f[2], id)
				if err != nil {
					return nil, err
				}
				peak, err := readInt(filepath.Join(mem, "memory.max_usage_in_bytes"))
				if err != nil {
					return nil, err
				}
				rss, err := statValue(filepath.Join(mem, "memory.stat"), "total_rss")
				if err != nil {
					return nil, err
				}
				cpuDir, err := cgroupDir("cpuacct", f[2], id)
				if err != nil {
					return nil, err
				}
				ns, err := readInt(filepath.Join(cpuDir, "cpuacct.usage"))
				if err != nil {
					return nil, err
				}
				pending[i].peakBytes, pending[i].rssBytes, pending[i].cpu = peak, rss, time.Duration(ns)
			}
			uses = append(uses, pending...)
			pending, ids = nil, nil
		case len(f) == 3:
			started, err := time.Parse(time.RFC3339, f[2])
			if err != nil {
				return nil, fmt.Errorf("container %s started at %q: %w", f[0], f[2], err)
			}
			pending = append(pending, containerUse{container: f[0], age: time.Since(started)})
			ids = append(ids, f[1])
		case len(f) > 0:
			return nil, fmt.Errorf("unexpected container status line %q", l)
		}
	}
	slices.SortFunc(uses, func(a, b containerUse) int {
		return strings.Compare(a.pod+"/"+a.container, b.pod+"/"+b.container)
	})
	return uses, nil
}

// measureResources logs what each container of the driver used so far
// (the chart's default requests and limits come from these numbers,
// values.yaml says which run), and checks every container was found.
func (s *suite) measureResources(when string) {
	s.step("resources: "+when, func() {
		uses, err := s.resourceUse()
		if err != nil {
			s.t.Fatalf("reading the driver's containers' cgroups: %v", err)
		}
		var b strings.Builder
		fmt.Fprintf(&b, "what the driver's containers used (%s):\n%-44s %-26s %10s %10s %8s\n", when, "pod", "container", "peak MiB", "CPU s", "age s")
		for _, u := range uses {
			fmt.Fprintf(&b, "%-44s %-26s %10.1f %10.2f %8.0f\n", u.pod, u.container, float64(u.peakBytes)/(1<<20), u.cpu.Seconds(), u.age.Seconds())
			if u.peakBytes <= 0 {
				s.t.Errorf("container %s/%s: no memory use read", u.pod, u.container)
			}
		}
		s.t.Log(b.String())
		if len(uses) < 8 {
			s.t.Errorf("found %d containers of the driver, want the controller's, the node plugin's, the datapath's and the storage agent's", len(uses))
		}
	})
}
