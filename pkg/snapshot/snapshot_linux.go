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

package snapshot

import (
	"context"
	"errors"
	"io"
	"io/fs"
	"os"

	"golang.org/x/sys/unix"
)

// Bounds of the copy with change tracking: at most recopyRounds copies of
// the changed ranges are made while writes flow; a round that finds less
// than recopyEnough changed is the last, as the next one (with writes
// held) has about as much as changed while it ran.
const (
	recopyRounds = 4
	recopyEnough = 16 << 20
)

// clone fills out from in, by reflink or by copy, holding the source's
// writes through h while it reads the source for the snapshot's point.
func clone(ctx context.Context, in, out *os.File, o *options, h *writeHold, res *Result) error {
	tracked := o.changes != nil && o.quiesce != nil
	reflink := !o.noReflink
	if reflink && tracked {
		// Holding writes to find out that the filesystem cannot reflink
		// would stall them for a flush for nothing.
		var err error
		if reflink, err = mayReflink(in, out); err != nil {
			return err
		}
	}
	if reflink || !tracked {
		if err := h.hold(ctx); err != nil {
			return err
		}
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	if reflink {
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
	res.Method = Copy
	c := copier{in: in, out: out, useCFR: true, copied: &res.Copied}
	if tracked {
		h.release()
		return copyTracked(ctx, &c, o, h, res)
	}
	size, err := fileSize(in)
	if err != nil {
		return err
	}
	// The size first: the data ranges are then written in place and what
	// is not written stays a hole.
	if err := out.Truncate(size); err != nil {
		return err
	}
	res.Size = size
	return c.copyData(ctx, 0, size, o.chunk)
}

// copyTracked copies the source while its writes flow, copies again what
// changed meanwhile, and holds the writes through h only for the last
// changes (see the package documentation).
func copyTracked(ctx context.Context, c *copier, o *options, h *writeHold, res *Result) error {
	take, stop := o.changes()
	defer stop()
	size, err := fileSize(c.in)
	if err != nil {
		return err
	}
	if err := c.out.Truncate(size); err != nil {
		return err
	}
	if err := c.copyData(ctx, 0, size, o.chunk); err != nil {
		return err
	}
	for range recopyRounds {
		n, err := c.recopy(ctx, take(), o.chunk, &res.Recopied)
		if err != nil {
			return err
		}
		if n < recopyEnough {
			break
		}
	}
	// Write back what the writers left dirty now, while they run, so that
	// the flush under the hold has little left to do. Only a shortcut:
	// Quiesce's own flush is what counts, and reports errors.
	_ = unix.Fdatasync(int(c.in.Fd()))
	if err := h.hold(ctx); err != nil {
		return err
	}
	if _, err := c.recopy(ctx, take(), o.chunk, &res.Recopied); err != nil {
		return err
	}
	if size, err = fileSize(c.in); err != nil {
		return err
	}
	if err := c.out.Truncate(size); err != nil {
		return err
	}
	res.Size = size
	h.release()
	return nil
}

// mayReflink tries to share the source's first block with out, which is
// empty and stays so: false when the filesystem refuses for certain,
// true when the whole-file FICLONE may succeed.
func mayReflink(in, out *os.File) (bool, error) {
	var st unix.Stat_t
	if err := unix.Fstat(int(in.Fd()), &st); err != nil {
		return false, &fs.PathError{Op: "fstat", Path: in.Name(), Err: err}
	}
	n := uint64(0) // to the end of a file shorter than a block
	if st.Size >= int64(st.Blksize) {
		n = uint64(st.Blksize)
	}
	err := unix.IoctlFileCloneRange(int(out.Fd()), &unix.FileCloneRange{Src_fd: int64(in.Fd()), Src_length: n})
	if errors.Is(err, unix.EOPNOTSUPP) || errors.Is(err, unix.EXDEV) || errors.Is(err, unix.ENOTTY) {
		return false, nil
	}
	// Anything else, success included, is for the FICLONE to settle.
	if err := out.Truncate(0); err != nil {
		return false, err
	}
	return true, nil
}

func fileSize(f *os.File) (int64, error) {
	fi, err := f.Stat()
	if err != nil {
		return 0, err
	}
	return fi.Size(), nil
}

// refused reports whether FICLONE failed because the filesystem (or the
// pair of files) cannot share extents, rather than because of an I/O or
// space problem.
func refused(err error) bool {
	return errors.Is(err, unix.EOPNOTSUPP) || errors.Is(err, unix.EXDEV) ||
		errors.Is(err, unix.EINVAL) || errors.Is(err, unix.ENOTTY)
}

// copier copies ranges of in to the same offsets of out, with
// copy_file_range, or with read and write once the kernel refuses
// copy_file_range for this pair of files. It adds the bytes it copies to
// *copied.
type copier struct {
	in, out *os.File
	useCFR  bool
	buf     []byte
	copied  *int64
	noPunch bool // out cannot punch holes
}

// copyData copies the data extents of in within [from, to), chunk bytes
// at a time, leaving out's holes there as they are.
func (c *copier) copyData(ctx context.Context, from, to, chunk int64) error {
	for off := from; off < to; {
		start, end, err := nextData(c.in, off, to)
		if err != nil {
			return err
		}
		if start >= to {
			return nil
		}
		if err := c.copyAll(ctx, start, end, chunk); err != nil {
			return err
		}
		off = end
	}
	return nil
}

// copyAll copies [from, to) whole, holes read as zeroes, chunk bytes at a
// time.
func (c *copier) copyAll(ctx context.Context, from, to, chunk int64) error {
	for pos := from; pos < to; {
		if err := ctx.Err(); err != nil {
			return err
		}
		n, err := c.copyRange(pos, min(chunk, to-pos))
		if err != nil {
			return err
		}
		if n == 0 {
			// The source shrank under us; what is left reads as zeroes
			// and the destination has them as a hole, or is cut to the
			// source's size at the end.
			return nil
		}
		pos += n
		*c.copied += n
	}
	return nil
}

// recopy makes out equal to in over each of ranges (clipped to in's size),
// holes included: the range is punched out of out, then in's data in it
// copied. It returns the bytes the ranges cover and adds those it copied
// to *recopied.
func (c *copier) recopy(ctx context.Context, ranges []Range, chunk int64, recopied *int64) (int64, error) {
	if len(ranges) == 0 {
		return 0, nil
	}
	size, err := fileSize(c.in)
	if err != nil {
		return 0, err
	}
	before := *c.copied
	defer func() { *recopied += *c.copied - before }()
	var covered int64
	for _, r := range ranges {
		from, to := max(r.Off, 0), min(r.Off+r.Len, size)
		if from >= to {
			continue
		}
		covered += to - from
		if !c.noPunch {
			err := unix.Fallocate(int(c.out.Fd()), unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, from, to-from)
			switch {
			case errors.Is(err, unix.EOPNOTSUPP):
				c.noPunch = true
			case err != nil:
				return covered, &fs.PathError{Op: "punch", Path: c.out.Name(), Err: err}
			}
		}
		if c.noPunch {
			// Without holes to punch, the holes are copied as zeroes.
			err = c.copyAll(ctx, from, to, chunk)
		} else {
			err = c.copyData(ctx, from, to, chunk)
		}
		if err != nil {
			return covered, err
		}
	}
	return covered, nil
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
