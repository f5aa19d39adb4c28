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

package access

import (
	"fmt"
	"strings"

	"k8s.io/apimachinery/pkg/util/validation"
)

// TopologyKey is the topology segment every node plugin and storage agent
// reports unless configured otherwise: the storage network it is on. A
// volume is accessible from the nodes whose segments match its storage
// node's, so nodes and storage nodes on one network need no topology
// configuration at all.
const (
	TopologyKey     = "topology.mpnbd.io/storage-network"
	DefaultTopology = "default"
)

// ParseTopology parses "key=value[,key=value...]" into topology segments
// (keys are qualified names, values label values). The empty string gives
// the default segment.
func ParseTopology(s string) (map[string]string, error) {
	if strings.TrimSpace(s) == "" {
		return map[string]string{TopologyKey: DefaultTopology}, nil
	}
	out := map[string]string{}
	for _, kv := range strings.Split(s, ",") {
		kv = strings.TrimSpace(kv)
		k, v, ok := strings.Cut(kv, "=")
		if !ok || k == "" {
			return nil, fmt.Errorf("topology %q: want KEY=VALUE[,KEY=VALUE...]", kv)
		}
		if errs := validation.IsQualifiedName(k); len(errs) > 0 {
			return nil, fmt.Errorf("topology key %q: %s", k, strings.Join(errs, "; "))
		}
		if errs := validation.IsValidLabelValue(v); len(errs) > 0 {
			return nil, fmt.Errorf("topology value %q: %s", v, strings.Join(errs, "; "))
		}
		if _, dup := out[k]; dup {
			return nil, fmt.Errorf("topology key %q is given twice", k)
		}
		out[k] = v
	}
	return out, nil
}
