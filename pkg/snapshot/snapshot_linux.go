package snapshot

import (
	"context"
	"errors"
	"io"
	"io/fs"
	"os"

	"golang.org/x/sys/unix"
)

// clone fills out from in, by reflink or by copy, with writes held.
func clone(ctx context.Context, in, out *os.File, o *options, res *Result) error {
	if !o.noReflink {
		err := unix.IoctlFileClone(int(out.Fd()), int(in.Fd()))
		switch {
		case err == nil:
			fi, err := out.Stat()
			if err != nil {
				return err
			}
			res.Method, res.Size = Reflink, fi.Size()
			return nil
		case !refused(err):
			return &fs.PathError{Op: "ficlone", Path: in.Name(), Err: err}
		}
	}
	fi, err := in.Stat()
	if err != nil {
		return err
	}
	size := fi.Size()
	// The size first: the data ranges are then written in place and what
	// is not written stays a hole.
	if err := out.Truncate(size); err != nil {
		return err
	}
	res.Method, res.Size = Copy, size
	return copySparse(ctx, in, out, size, o.chunk, &res.Copied)
}

// refused reports whether FICLONE failed because the filesystem (or the
// pair of files) cannot share extents, rather than because of an I/O or
// space problem.
func refused(err error) bool {
	return errors.Is(err, unix.EOPNOTSUPP) || errors.Is(err, unix.EXDEV) ||
		errors.Is(err, unix.EINVAL) || errors.Is(err, unix.ENOTTY)
}

// copySparse copies the data extents of in below size to the same offsets
// of out, chunk bytes at a time, adding what it copied to *copied.
func copySparse(ctx context.Context, in, out *os.File, size, chunk int64, copied *int64) error {
	c := copier{in: in, out: out, useCFR: true}
	for off := int64(0); off < size; {
		start, end, err := nextData(in, off, size)
		if err != nil {
			return err
		}
		if start >= size {
			return nil
		}
		for pos := start; pos < end; {
			if err := ctx.Err(); err != nil {
				return err
			}
			n, err := c.copyRange(pos, min(chunk, end-pos))
			if err != nil {
				return err
			}
			if n == 0 {
				// The source shrank under us; what is left reads as zeroes
				// and the destination already has them as a hole.
				return nil
			}
			pos += n
			*copied += n
		}
		off = end
	}
	return nil
}

// nextData returns the next data range at or after off, clipped to size;
// start == size when there is none. A filesystem that cannot tell data
// from holes reports the whole rest as data.
func nextData(f *os.File, off, size int64) (start, end int64, err error) {
	fd := int(f.Fd())
	start, err = unix.Seek(fd, off, unix.SEEK_DATA)
	switch {
	case errors.Is(err, unix.ENXIO):
		return size, size, nil
	case errors.Is(err, unix.EINVAL) || errors.Is(err, unix.EOPNOTSUPP):
		return off, size, nil
	case err != nil:
		return 0, 0, &fs.PathError{Op: "seek_data", Path: f.Name(), Err: err}
	}
	if start >= size {
		return size, size, nil
	}
	end, err = unix.Seek(fd, start, unix.SEEK_HOLE)
	switch {
	case errors.Is(err, unix.ENXIO):
		end = size
	case err != nil:
		return 0, 0, &fs.PathError{Op: "seek_hole", Path: f.Name(), Err: err}
	}
	return start, min(end, size), nil
}

// copier copies ranges with copy_file_range, or with read and write once
// the kernel refuses copy_file_range for this pair of files.
type copier struct {
	in, out *os.File
	useCFR  bool
	buf     []byte
}

// copyRange copies up to n bytes at off; 0 means the source ended.
func (c *copier) copyRange(off, n int64) (int64, error) {
	if c.useCFR {
		roff, woff := off, off
		m, err := unix.CopyFileRange(int(c.in.Fd()), &roff, int(c.out.Fd()), &woff, int(n), 0)
		switch {
		case err == nil:
			return int64(m), nil
		case errors.Is(err, unix.EXDEV) || errors.Is(err, unix.EOPNOTSUPP) ||
			errors.Is(err, unix.ENOSYS) || errors.Is(err, unix.EINVAL):
			c.useCFR = false
		default:
			return 0, &fs.PathError{Op: "copy_file_range", Path: c.in.Name(), Err: err}
		}
	}
	if c.buf == nil {
		c.buf = make([]byte, 1<<20)
	}
	buf := c.buf[:min(n, int64(len(c.buf)))]
	m, err := c.in.ReadAt(buf, off)
	if m == 0 {
		if err == io.EOF {
			return 0, nil
		}
		return 0, err
	}
	if _, err := c.out.WriteAt(buf[:m], off); err != nil {
		return 0, err
	}
	return int64(m), nil
}

// renameNoReplace renames oldpath to newpath, failing with fs.ErrExist
// rather than replacing an existing newpath.
func renameNoReplace(oldpath, newpath string) error {
	err := unix.Renameat2(unix.AT_FDCWD, oldpath, unix.AT_FDCWD, newpath, unix.RENAME_NOREPLACE)
	if errors.Is(err, unix.EINVAL) || errors.Is(err, unix.ENOSYS) {
		// A filesystem without RENAME_NOREPLACE: check, then rename (a
		// race with another writer of newpath is the caller's).
		if _, serr := os.Lstat(newpath); serr == nil {
			return &os.LinkError{Op: "rename", Old: oldpath, New: newpath, Err: fs.ErrExist}
		}
		return os.Rename(oldpath, newpath)
	}
	if err != nil {
		if errors.Is(err, unix.EEXIST) {
			err = fs.ErrExist
		}
		return &os.LinkError{Op: "rename", Old: oldpath, New: newpath, Err: err}
	}
	return nil
}

// allocated is the space f uses on disk.
func allocated(f *os.File) (int64, error) {
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return 0, &fs.PathError{Op: "fstat", Path: f.Name(), Err: err}
	}
	return st.Blocks * 512, nil
}
