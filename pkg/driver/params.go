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

package driver

import (
	"fmt"
	"maps"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/mpnbd/mpnbd/api/v1alpha1"
	"github.com/mpnbd/mpnbd/pkg/attach"
	"github.com/mpnbd/mpnbd/pkg/relay"
)

// StorageClass parameter keys.
const (
	ParamFSType          = "fsType"
	ParamTransport       = "transport"
	ParamStorageNode     = "storageNode"
	ParamNodeSelector    = "storageNodeSelector"
	ParamDeadConnTimeout = "deadConnTimeout"
	ParamRequestTimeout  = "requestTimeout"
	ParamDeadPeerTimeout = "deadPeerTimeout"
	ParamBlockSize       = "blockSize"
	ParamEncryption      = "encryption"
	ParamReplicas        = "replicas"

	// reservedPrefix marks keys the Kubernetes sidecars add or reserve.
	reservedPrefix = "csi.storage.k8s.io/"
)

// MaxReplicas is the most storage nodes a volume's data is kept on.
const MaxReplicas = 3

// Params are validated StorageClass parameters.
type Params struct {
	FSType          string
	Transport       attach.Transport
	StorageNode     string
	NodeSelector    map[string]string
	DeadConnTimeout time.Duration
	RequestTimeout  time.Duration
	// DeadPeerTimeout: how long a data connection waits on a silent
	// storage host before it is replaced (attach.DefaultDeadPeerTimeout).
	DeadPeerTimeout time.Duration
	BlockSize       uint64
	// Encryption is none (the default), preferred or required.
	Encryption v1alpha1.Encryption
	// Replicas is how many storage nodes hold the volume's data (1 to
	// MaxReplicas; docs/replication.md).
	Replicas int
}

// ParseParams validates StorageClass parameters. Every unknown or invalid
// key is an InvalidArgument error that names it.
func ParseParams(in map[string]string) (Params, error) {
	p := Params{FSType: "ext4", Transport: attach.Auto, Encryption: v1alpha1.EncryptionNone, Replicas: 1}
	keys := make([]string, 0, len(in))
	for k := range in {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		v := in[k]
		bad := func(why string) (Params, error) {
			return Params{}, fmt.Errorf("%w: StorageClass parameter %s=%q: %s", ErrInvalidArgument, k, v, why)
		}
		switch k {
		case ParamFSType:
			if v != "ext4" && v != "xfs" {
				return bad("want ext4 or xfs")
			}
			p.FSType = v
		case ParamTransport:
			t, err := attach.ParseTransport(v)
			if err != nil {
				return bad("want one of auto, kernel, ublk, relay, multiconn, tcp, fuse")
			}
			p.Transport = t
		case ParamStorageNode:
			if v == "" || strings.ContainsAny(v, " /,") {
				return bad("want a node name")
			}
			p.StorageNode = v
		case ParamNodeSelector:
			sel, err := parseSelector(v)
			if err != nil {
				return bad(err.Error())
			}
			p.NodeSelector = sel
		case ParamDeadConnTimeout, ParamRequestTimeout:
			d, err := time.ParseDuration(v)
			if err != nil || d < 0 || d > 24*time.Hour {
				return bad("want a duration between 0s and 24h, e.g. 120s")
			}
			if k == ParamDeadConnTimeout {
				p.DeadConnTimeout = d
			} else {
				p.RequestTimeout = d
			}
		case ParamDeadPeerTimeout:
			d, err := time.ParseDuration(v)
			if err != nil || d < relay.MinDeadPeerTimeout || d > 10*time.Minute {
				return bad(fmt.Sprintf("want a duration between %v and 10m, e.g. 5s", relay.MinDeadPeerTimeout))
			}
			p.DeadPeerTimeout = d
		case ParamBlockSize:
			n, err := strconv.ParseUint(v, 10, 64)
			if err != nil || (n != 512 && n != 1024 && n != 2048 && n != 4096) {
				return bad("want 512, 1024, 2048 or 4096")
			}
			p.BlockSize = n
		case ParamReplicas:
			n, err := strconv.Atoi(v)
			if err != nil || n < 1 || n > MaxReplicas {
				return bad(fmt.Sprintf("want 1 to %d storage nodes holding the volume's data", MaxReplicas))
			}
			p.Replicas = n
		case ParamEncryption:
			switch e := v1alpha1.Encryption(v); e {
			case v1alpha1.EncryptionNone, v1alpha1.EncryptionPreferred, v1alpha1.EncryptionRequired:
				p.Encryption = e
			default:
				return bad("want none, preferred or required")
			}
		default:
			if strings.HasPrefix(k, reservedPrefix) {
				continue
			}
			return bad("unknown parameter")
		}
	}
	if p.DeadPeerTimeout > 0 && p.RequestTimeout > 0 && p.RequestTimeout < 2*p.DeadPeerTimeout {
		// A kernel socket must be dead, its unsent requests dropped,
		// before the kernel's request timeout requeues them elsewhere.
		return Params{}, fmt.Errorf("%w: StorageClass parameters %s=%s and %s=%s: the request timeout must be at least twice the dead-peer timeout",
			ErrInvalidArgument, ParamRequestTimeout, p.RequestTimeout, ParamDeadPeerTimeout, p.DeadPeerTimeout)
	}
	if p.Encryption == v1alpha1.EncryptionRequired && p.Transport != attach.Auto && !attach.CanEncrypt(p.Transport) {
		return Params{}, fmt.Errorf("%w: StorageClass parameters %s=%s and %s=%s: %s; use encryption preferred or none, or another transport",
			ErrInvalidArgument, ParamEncryption, p.Encryption, ParamTransport, p.Transport, attach.NoEncryption(p.Transport))
	}
	return p, nil
}

// withDefaults is a StorageClass's parameters with the controller's
// defaults applied: a class that names no encryption gets
// DefaultEncryption. It returns in itself when nothing is added. A
// default of required on a class whose transport cannot encrypt is an
// InvalidArgument error that says where the requirement comes from.
func (c *Controller) withDefaults(in map[string]string) (map[string]string, error) {
	def := c.cfg.DefaultEncryption
	if _, named := in[ParamEncryption]; named || def == "" || def == v1alpha1.EncryptionNone {
		return in, nil
	}
	if def == v1alpha1.EncryptionRequired {
		if t, err := attach.ParseTransport(in[ParamTransport]); err == nil && t != attach.Auto && !attach.CanEncrypt(t) {
			return nil, fmt.Errorf("%w: StorageClass parameter %s=%s: the class names no %s, so the controller's default (%s: --default-encryption, the chart's defaultEncryption) applies, and %s; set %s preferred or none in the class, or another transport",
				ErrInvalidArgument, ParamTransport, in[ParamTransport], ParamEncryption, def, attach.NoEncryption(t), ParamEncryption)
		}
	}
	out := maps.Clone(in)
	if out == nil {
		out = map[string]string{}
	}
	out[ParamEncryption] = string(def)
	return out, nil
}

// parseSelector parses "k1=v1,k2=v2".
func parseSelector(s string) (map[string]string, error) {
	out := map[string]string{}
	for _, part := range strings.Split(s, ",") {
		k, v, ok := strings.Cut(strings.TrimSpace(part), "=")
		if !ok || k == "" {
			return nil, fmt.Errorf("want key=value[,key=value]")
		}
		out[k] = v
	}
	return out, nil
}
