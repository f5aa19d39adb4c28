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

// Package access is the contract between the controller, which grants a
// node access to a volume, and the storage agent, which enforces it.
//
// ControllerPublishVolume lists the node in the volume's
// spec.publications. How the node then proves who it is depends on the
// volume:
//
//   - An encrypted volume (spec.encryption required): the node shows its
//     node certificate over TLS (pkg/nodeid) and opens the export by the
//     volume's name. No token exists.
//   - Every other volume (the kernel, tcp and multiconn transports speak
//     plaintext): the node presents a token in the export name it asks
//     for, NodeExport(volume, token).
//
// The token is the node's own: its node plugin makes it once (a random
// NewToken, kept in a file of its state directory that only it reads,
// LoadOrCreateToken) and announces its TokenHash on its Node object
// (AnnotationTokenSHA256, next to AnnotationStorageAddresses; an
// admission policy lets the node plugin change only those annotations,
// and only on its own Node). ControllerPublishVolume copies both into the
// publication. The token itself so never leaves the node but in the NBD
// handshakes with the storage agents that serve it: it is in no Secret,
// no publish context and so no VolumeAttachment (which Kubernetes keeps
// cluster-scoped, readable by many), and no Kubernetes object names it.
// A per-(volume, node) Secret that the node plugin read itself could not
// be scoped to its node: RBAC grants a ServiceAccount a resource for all
// its pods alike, an admission policy does not guard reads, and the
// kubelet's node-stage secrets are named per volume by the StorageClass
// (whose parameters cannot change on a class made before).
//
// The storage agent serves a token connection only while a publication
// carries that token's hash, and only from one of the publication's
// addresses: ControllerPublishVolume refuses a node that announced none,
// and the agent grants nothing by a publication of a node's token that
// lists none, so a token is useless from any host but its node (its node
// plugin announces the --storage-address flags, or else every global
// address of the host). MPTCP subflows joining later are held to the same
// addresses (the agent's join guard). A token can be replayed only by one
// who can both read a node's storage traffic and send from its address:
// on a storage network where that is a concern, use encryption.
//
// Every publication has an epoch (the volume's generation when it was
// made, so it rises with every publish), which the controller puts in the
// publish context and the node in the export name it opens (ExportName).
// The agent serves a connection only at its publication's epoch and
// refuses an older one as superseded; a node's data path takes that
// refusal, and only that one, as final: it fails its I/O with EIO and
// drops the writes it kept for replay, instead of redialing. So a fenced
// node (partitioned, force-detached) whose old session kept redialing is
// not let back in when the volume is later published to it again, with
// the same token or the same certificate, to replay stale writes over
// what another node wrote meanwhile. A refusal for any other reason (an
// agent restarting that does not know the export yet, a publication not
// yet applied or already removed) may pass, so the data path dials again
// and a healthy session survives it (see ExportName for the rule).
//
// Publications made by earlier controllers name a per-(volume, node)
// Secret (SecretRef, named by SecretName, the token under SecretKeyToken)
// whose token the node got in its export name; they keep working on the
// terms they were made under (without addresses, if their node announced
// none then, until the controller adds those it announces now) until the
// volume is unpublished from that node.
package access

import (
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/hex"
	"fmt"
	"strings"
)

const (
	// SecretKeyToken is the key of the token in a publication's Secret.
	SecretKeyToken = "token"
	// LabelVolume and LabelNode label publication Secrets.
	LabelVolume = "mpnbd.io/volume"
	LabelNode   = "mpnbd.io/node"
	// AnnotationTokenSHA256, on a Kubernetes Node, is the TokenHash of
	// the node's token. The node plugin sets it; ControllerPublishVolume
	// copies it into the publications of volumes without encryption.
	AnnotationTokenSHA256 = "mpnbd.io/storage-token-sha256"
	// AnnotationStorageAddresses, on a Kubernetes Node, lists the node's
	// storage IP addresses (comma-separated). The node plugin sets it;
	// ControllerPublishVolume copies it into the publication.
	AnnotationStorageAddresses = "mpnbd.io/storage-addresses"
	// AnnotationCSIName, on an NBDVolume, is the name CreateVolume got.
	AnnotationCSIName = "mpnbd.io/csi-name"
	// AnnotationVolumeSnapshot, on an NBDSnapshot, is the namespace/name
	// of the VolumeSnapshot it was taken for, when the snapshotter said.
	AnnotationVolumeSnapshot = "mpnbd.io/volumesnapshot"

	// tokenBytes is the token's entropy.
	tokenBytes = 16
	// separator joins the volume and the token in an export name. Volume
	// names are DNS subdomains, so it never occurs in one.
	separator = "/"
)

// NewToken returns a fresh random token (32 hex digits).
func NewToken() (string, error) {
	b := make([]byte, tokenBytes)
	if _, err := rand.Read(b); err != nil {
		return "", fmt.Errorf("access: random token: %w", err)
	}
	return hex.EncodeToString(b), nil
}

// ValidToken reports whether s has the form NewToken makes.
func ValidToken(s string) bool {
	if len(s) != 2*tokenBytes {
		return false
	}
	_, err := hex.DecodeString(s)
	return err == nil
}

// NodeExport is the export name a node opens for a volume.
func NodeExport(volume, token string) string {
	return volume + separator + token
}

// SplitExport undoes NodeExport. ok is false for names NodeExport does not
// make.
func SplitExport(name string) (volume, token string, ok bool) {
	volume, token, ok = strings.Cut(name, separator)
	if !ok || volume == "" || !ValidToken(token) {
		return "", "", false
	}
	return volume, token, true
}

// TokenEqual compares two tokens in constant time.
func TokenEqual(a, b string) bool {
	return subtle.ConstantTimeCompare([]byte(a), []byte(b)) == 1
}

// TokenHash is what a publication keeps of its token: its SHA-256 in
// hex. Whoever can read the hash cannot present the token.
func TokenHash(token string) string {
	sum := sha256.Sum256([]byte(token))
	return hex.EncodeToString(sum[:])
}

// ValidTokenHash reports whether s has the form TokenHash makes.
func ValidTokenHash(s string) bool {
	if len(s) != 2*sha256.Size || strings.ToLower(s) != s {
		return false
	}
	_, err := hex.DecodeString(s)
	return err == nil
}

// TokenMatches reports, in constant time, whether token is the one whose
// TokenHash is hash.
func TokenMatches(hash, token string) bool {
	return hash != "" && subtle.ConstantTimeCompare([]byte(hash), []byte(TokenHash(token))) == 1
}

// SecretName names the Secret of the publication of volume to nodeID. It
// is a valid object name for any inputs, and differs for different pairs.
func SecretName(volume, nodeID string) string {
	sum := sha256.Sum256([]byte(volume + "\x00" + nodeID))
	return "mpnbd-pub-" + hex.EncodeToString(sum[:12])
}
