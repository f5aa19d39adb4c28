//go:build !linux

package snapshot

import "os"

// Space is what a file uses on disk.
type Space struct {
	// Allocated is the bytes of the file's blocks, the shared ones
	// included (the file's size where allocation is not known).
	Allocated int64
	// Shared is the bytes of the file's extents that the filesystem shares
	// with another file (a reflink); always 0 here, where extents are not
	// mapped.
	Shared int64
}

// Usage reports the space the file at path uses: its allocated bytes as
// far as they are known, and no sharing.
func Usage(path string) (Space, error) {
	f, err := os.Open(path)
	if err != nil {
		return Space{}, err
	}
	defer f.Close()
	alloc, err := allocated(f)
	if err != nil {
		return Space{}, err
	}
	return Space{Allocated: alloc}, nil
}
