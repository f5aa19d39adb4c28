// Package access is the contract between the controller, which grants a
// node access to a volume, and the storage agent, which enforces it.
//
// ControllerPublishVolume makes a random token per (volume, node), keeps
// it in a Secret in the driver's namespace (named by SecretName, the token
// under SecretKeyToken, labelled with LabelVolume and LabelNode, owned by
// the NBDVolume) and lists the node in the volume's spec.publications
// with that Secret's name. The node opens the export named
// NodeExport(volume, token); the storage agent serves it only while a
// publication with that token exists and, when the publication lists
// addresses, only to connections from one of them.
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
