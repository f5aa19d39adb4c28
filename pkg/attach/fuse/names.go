package fuse

import (
	"crypto/sha256"
	"encoding/hex"
	"regexp"
)

var plainName = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$`)

// volumeName is the name of a volume's mount directory and file: the
// volume ID itself when it is a plain file name, else a digest of it.
func volumeName(volumeID string) string {
	if plainName.MatchString(volumeID) {
		return volumeID
	}
	sum := sha256.Sum256([]byte(volumeID))
	return "v-" + hex.EncodeToString(sum[:16])
}
