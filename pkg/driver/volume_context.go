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
	"net"
	"strconv"
	"strings"

	"github.com/mpnbd/mpnbd/api/v1alpha1"
	"github.com/mpnbd/mpnbd/pkg/access"
	"github.com/mpnbd/mpnbd/pkg/attach"
)

// Publish context keys, set by ControllerPublishVolume and read by the
// node plugin.
const (
	// PublishContextExport is the NBD export's base name. The node adds
	// its own token (access.NodeExport) unless the volume is encrypted.
	// Publications made by earlier controllers give the name with a
	// per-(volume, node) token already in it; it is used as it is.
	PublishContextExport = "export"
	// PublishContextAddresses lists the storage node's addresses
	// (host:port, comma-separated); the first is the primary one.
	PublishContextAddresses = "addresses"
	// PublishContextStorageNode names the storage node: its certificate
	// must name it when the connection runs TLS.
	PublishContextStorageNode = "storageNode"
	// PublishContextEpoch is the epoch of the node's publication
	// (access.ExportName), absent for one made before epochs.
	PublishContextEpoch = "epoch"
	// PublishContextReplicas lists the other storage nodes of a
	// replicated volume, one of which takes over if the primary goes:
	// "<node>=<host:port>,<host:port>;<node>=..." (absent for an
	// unreplicated volume).
	PublishContextReplicas = "replicas"
)

// Volume context keys the controller adds to a volume made for a claim
// (CreateVolume, with the provisioner's --extra-create-metadata): the
// node plugin names the claim in its metrics (mpnbd_node_volume_info).
// The NBDVolume carries them as annotations of the same names.
const (
	VolumeContextPVCName      = "mpnbd.io/pvc-name"
	VolumeContextPVCNamespace = "mpnbd.io/pvc-namespace"
)

// nodeParamKeys are the StorageClass parameters (copied into the volume
// context) that matter on the node. Everything else in the volume context
// (the provisioner's identity, pod info, controller-only parameters) is
// ignored here: the controller validated it when the volume was created.
var nodeParamKeys = []string{ParamFSType, ParamTransport, ParamDeadConnTimeout, ParamRequestTimeout, ParamDeadPeerTimeout, ParamBlockSize, ParamEncryption}

// attachSpec is what the node needs to attach a volume.
type attachSpec struct {
	Transport attach.Transport
	Target    attach.Target
	Options   attach.Options
	// FSType is the StorageClass's fsType (ext4 unless set).
	FSType string
}

// parseAttachSpec builds the attach target of a volume from the publish
// and volume contexts; an encrypted volume's connections use the node
// certificate kept in identityDir, every other volume's the node's token
// (access.LoadOrCreateToken). A missing or malformed key is an
// InvalidArgument error that names it.
func parseAttachSpec(volumeID string, publishCtx, volumeCtx map[string]string, identityDir, token string) (attachSpec, error) {
	export := strings.TrimSpace(publishCtx[PublishContextExport])
	if export == "" {
		return attachSpec{}, fmt.Errorf("%w: publish context %q is missing", ErrInvalidArgument, PublishContextExport)
	}
	addrs, err := parseAddresses(publishCtx[PublishContextAddresses])
	if err != nil {
		return attachSpec{}, err
	}
	params := map[string]string{}
	for _, k := range nodeParamKeys {
		if v, ok := volumeCtx[k]; ok {
			params[k] = v
		}
	}
	p, err := ParseParams(params)
	if err != nil {
		return attachSpec{}, fmt.Errorf("volume context: %w", err)
	}
	var epoch int64
	if s, ok := publishCtx[PublishContextEpoch]; ok {
		if epoch, err = strconv.ParseInt(strings.TrimSpace(s), 10, 64); err != nil || epoch <= 0 {
			return attachSpec{}, fmt.Errorf("%w: publish context %q: %q is not a publication epoch", ErrInvalidArgument, PublishContextEpoch, s)
		}
	}
	if _, _, legacy := access.SplitExport(export); legacy {
		// An earlier controller's, with the token in it.
		token = ""
	} else if p.Encryption == v1alpha1.EncryptionRequired {
		token = ""
	} else if token == "" {
		return attachSpec{}, fmt.Errorf("%w: the volume is not encrypted and this node plugin has no node token", ErrPrecondition)
	}
	replicas, err := parseReplicas(publishCtx[PublishContextReplicas])
	if err != nil {
		return attachSpec{}, err
	}
	export = access.ExportName(export, token, epoch)
	target := attach.Target{VolumeID: volumeID, Export: export, Addrs: addrs, Replicas: replicas}
	switch {
	case p.Encryption == v1alpha1.EncryptionRequired && identityDir == "":
		return attachSpec{}, fmt.Errorf("%w: the volume is encrypted and this node plugin has no node certificate (--identity)", ErrPrecondition)
	case p.Encryption == v1alpha1.EncryptionRequired || p.Encryption == v1alpha1.EncryptionPreferred && identityDir != "":
		storageNode := strings.TrimSpace(publishCtx[PublishContextStorageNode])
		if storageNode == "" {
			return attachSpec{}, fmt.Errorf("%w: publish context %q is missing (the volume is encrypted)", ErrInvalidArgument, PublishContextStorageNode)
		}
		target.TLS = &attach.TargetTLS{StorageNode: storageNode, IdentityDir: identityDir,
			Optional: p.Encryption == v1alpha1.EncryptionPreferred}
	}
	return attachSpec{
		Transport: p.Transport,
		Target:    target,
		Options: attach.Options{
			DeadConnTimeout: p.DeadConnTimeout,
			RequestTimeout:  p.RequestTimeout,
			DeadPeerTimeout: p.DeadPeerTimeout,
			BlockSize:       p.BlockSize,
		},
		FSType: p.FSType,
	}, nil
}

// parseAddresses splits and checks the comma-separated host:port list.
func parseAddresses(s string) ([]string, error) {
	if strings.TrimSpace(s) == "" {
		return nil, fmt.Errorf("%w: publish context %q is missing", ErrInvalidArgument, PublishContextAddresses)
	}
	var out []string
	for _, a := range strings.Split(s, ",") {
		a = strings.TrimSpace(a)
		host, port, err := net.SplitHostPort(a)
		if err != nil || host == "" || port == "" {
			return nil, fmt.Errorf("%w: publish context %q: %q is not host:port", ErrInvalidArgument, PublishContextAddresses, a)
		}
		out = append(out, a)
	}
	return out, nil
}

// formatReplicas is the value of PublishContextReplicas for servers.
func formatReplicas(servers []attach.Server) string {
	parts := make([]string, len(servers))
	for i, s := range servers {
		parts[i] = s.StorageNode + "=" + strings.Join(s.Addrs, ",")
	}
	return strings.Join(parts, ";")
}

// parseReplicas reads PublishContextReplicas (none when empty).
func parseReplicas(s string) ([]attach.Server, error) {
	if strings.TrimSpace(s) == "" {
		return nil, nil
	}
	var out []attach.Server
	for _, part := range strings.Split(s, ";") {
		node, list, ok := strings.Cut(strings.TrimSpace(part), "=")
		if !ok || strings.TrimSpace(node) == "" {
			return nil, fmt.Errorf("%w: publish context %q: %q is not <storage node>=<host:port>[,<host:port>]", ErrInvalidArgument, PublishContextReplicas, part)
		}
		addrs, err := parseAddresses(list)
		if err != nil {
			return nil, fmt.Errorf("%w: publish context %q: storage node %s: %w", ErrInvalidArgument, PublishContextReplicas, node, err)
		}
		out = append(out, attach.Server{StorageNode: strings.TrimSpace(node), Addrs: addrs})
	}
	return out, nil
}
