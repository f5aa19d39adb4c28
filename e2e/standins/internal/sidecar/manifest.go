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

package sidecar

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/util/yaml"

	"github.com/mpnbd/mpnbd/internal/testenv/repo"
)

// ManifestArgs returns the args of the container named container in the
// pod templates of the workloads in the manifest file (relative to the
// module root, e.g. "deploy/controller.yaml"): what the chart passes
// the sidecar the stand-in replaces. Every occurrence is returned, one
// slice per workload.
func ManifestArgs(file, container string) ([][]string, error) {
	root, err := repo.Root()
	if err != nil {
		return nil, err
	}
	b, err := os.ReadFile(filepath.Join(root, file))
	if err != nil {
		return nil, err
	}
	dec := yaml.NewYAMLOrJSONDecoder(bytes.NewReader(b), 4096)
	var out [][]string
	for {
		var obj map[string]any
		if err := dec.Decode(&obj); err != nil {
			if errors.Is(err, io.EOF) {
				break
			}
			return nil, fmt.Errorf("%s: %w", file, err)
		}
		list, _, _ := unstructured.NestedSlice(obj, "spec", "template", "spec", "containers")
		for _, c := range list {
			m, ok := c.(map[string]any)
			if !ok || m["name"] != container {
				continue
			}
			args, _, err := unstructured.NestedStringSlice(m, "args")
			if err != nil {
				return nil, fmt.Errorf("%s: container %s: %w", file, container, err)
			}
			out = append(out, args)
		}
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("%s: no container %s", file, container)
	}
	return out, nil
}
