package agent

import (
	"io/fs"
	"syscall"

	"golang.org/x/sys/unix"
)

// fsSpace returns the size of dir's filesystem and the bytes still free
// to unprivileged writers.
func fsSpace(dir string) (capacity, free int64, err error) {
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		return 0, 0, &fs.PathError{Op: "statfs", Path: dir, Err: err}
	}
	return int64(st.Blocks) * st.Bsize, int64(st.Bavail) * st.Bsize, nil
}

// allocated is the bytes a file has on disk (st_blocks are 512 bytes).
func allocated(fi fs.FileInfo) int64 {
	if st, ok := fi.Sys().(*syscall.Stat_t); ok {
		return st.Blocks * 512
	}
	return fi.Size()
}
