// Package snapshot copies a volume's backing file to a snapshot file,
// crash-consistently and as cheaply as the filesystem allows.
//
// Clone first asks the filesystem to share the source's extents with the
// new file (FICLONE: a reflink on XFS with reflink=1 or on btrfs), which is
// instant and uses no space until either file is written. When the
// filesystem refuses, it copies the file itself, walking the source's data
// extents (SEEK_DATA/SEEK_HOLE) and copying only those, so holes stay
// holes and a thin volume gives a thin snapshot.
//
// The snapshot is built under a temporary name in the destination's
// directory, synced, renamed into place and the directory synced: after
// Clone returns the snapshot is durable, and on any error or cancellation
// neither the destination nor the temporary file is left behind. An
// existing destination is never replaced.
//
// # Crash consistency
//
// A snapshot is crash-consistent when it holds the volume as it was at one
// flush point: every write acknowledged before that point and none after,
// the state a client's filesystem recovers from after a power cut. Clone
// cannot make that point itself; the agent serving the volume does, through
// the Quiesce hook (WithQuiesce). Quiesce must
//
//   - stop acknowledging new writes to the export (hold them, not fail them),
//   - wait for the writes in flight to reach the backing file, and
//   - sync the backing file (the backend's Sync), so that the source is
//     durable up to the point the snapshot claims,
//
// and return a function that lets writes flow again. Clone calls Quiesce
// once, right before it starts, and the resume function once it has
// finished reading the source, whether it succeeded or not.
//
// How long writes are held depends on the method, and Result.Held reports
// it:
//
//   - reflink: the clone is a metadata operation, milliseconds even for a
//     large file, so holding writes around it is invisible to clients;
//   - copy: the source is read for the whole copy, so writes are held for
//     the whole copy, seconds per GiB of data. The alternative, copying
//     while writes flow and then copying again what changed, would need the
//     export to track dirty ranges; it is not done here. An agent that
//     cannot afford the pause needs a filesystem with reflink.
//
// The destination's sync and rename happen after resume: they no longer
// read the source.
//
// # Space
//
// Result.Allocated is the destination's st_blocks*512 after the sync. For
// a copy that is the space the snapshot uses. For a reflink it counts the
// extents shared with the source as the snapshot's too: the snapshot costs
// nothing at first and up to Allocated as the source is overwritten, which
// is the figure a thick capacity accounting must reserve.
package snapshot

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"time"
)

// Method is how a snapshot was made.
type Method string

const (
	// Reflink: the destination shares the source's extents (FICLONE).
	Reflink Method = "reflink"
	// Copy: the source's data extents were copied, holes kept as holes.
	Copy Method = "copy"
)

// Result describes a snapshot Clone made.
type Result struct {
	Method Method
	// Size is the destination's size, the source's at the flush point.
	Size int64
	// Copied is the bytes of data copied (0 for a reflink).
	Copied int64
	// Allocated is the space the destination uses on disk (st_blocks*512),
	// shared extents included.
	Allocated int64
	// Held is how long writes were held: from calling Quiesce to calling
	// its resume function (0 without a Quiesce hook).
	Held time.Duration
	// Duration is the whole Clone, syncs included.
	Duration time.Duration
}

// Option changes how Clone works.
type Option func(*options)

type options struct {
	quiesce   func(ctx context.Context) (resume func(), err error)
	noReflink bool
	chunk     int64
}

// WithQuiesce makes Clone call quiesce before it reads the source and the
// function quiesce returns once it has finished reading it (see the package
// documentation for what quiesce must do). A nil resume is allowed; an
// error ends the Clone with it, nothing made.
func WithQuiesce(quiesce func(ctx context.Context) (resume func(), err error)) Option {
	return func(o *options) { o.quiesce = quiesce }
}

// WithoutReflink skips FICLONE and always copies. (On XFS and btrfs the
// kernel may still share extents inside copy_file_range.)
func WithoutReflink() Option {
	return func(o *options) { o.noReflink = true }
}

// WithChunkSize sets how many bytes are copied between two checks of the
// context (default 8 MiB).
func WithChunkSize(n int64) Option {
	return func(o *options) {
		if n > 0 {
			o.chunk = n
		}
	}
}

const defaultChunk = 8 << 20

// Clone makes dst a point-in-time copy of the regular file src: a reflink
// when the filesystem can, else a sparse copy. dst must not exist
// (fs.ErrExist otherwise) and its directory must. On error nothing is left
// at dst nor under a temporary name.
func Clone(ctx context.Context, src, dst string, opts ...Option) (Result, error) {
	start := time.Now()
	o := options{chunk: defaultChunk}
	for _, opt := range opts {
		opt(&o)
	}
	if err := ctx.Err(); err != nil {
		return Result{}, err
	}
	in, err := os.Open(src)
	if err != nil {
		return Result{}, err
	}
	defer in.Close()
	if fi, err := in.Stat(); err != nil {
		return Result{}, err
	} else if !fi.Mode().IsRegular() {
		return Result{}, &fs.PathError{Op: "snapshot", Path: src, Err: errors.New("not a regular file")}
	}
	if _, err := os.Lstat(dst); err == nil {
		return Result{}, &fs.PathError{Op: "snapshot", Path: dst, Err: fs.ErrExist}
	}
	dir, base := filepath.Split(dst)
	if dir == "" {
		dir = "."
	}
	out, err := os.CreateTemp(dir, "."+base+".tmp-*")
	if err != nil {
		return Result{}, err
	}
	tmp := out.Name()
	committed := false
	defer func() {
		if !committed {
			out.Close()
			os.Remove(tmp)
		}
	}()

	var res Result
	if err := func() error {
		if o.quiesce != nil {
			held := time.Now()
			resume, err := o.quiesce(ctx)
			if err != nil {
				return fmt.Errorf("quiesce the source: %w", err)
			}
			defer func() {
				if resume != nil {
					resume()
				}
				res.Held = time.Since(held)
			}()
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		return clone(ctx, in, out, &o, &res)
	}(); err != nil {
		return Result{}, err
	}

	if err := out.Sync(); err != nil {
		return Result{}, fmt.Errorf("sync %s: %w", tmp, err)
	}
	if res.Allocated, err = allocated(out); err != nil {
		return Result{}, err
	}
	if err := out.Close(); err != nil {
		return Result{}, err
	}
	if err := ctx.Err(); err != nil {
		return Result{}, err
	}
	if err := renameNoReplace(tmp, dst); err != nil {
		return Result{}, err
	}
	committed = true
	if err := syncDir(dir); err != nil {
		// The snapshot is complete but its name may not survive a crash:
		// undo rather than report a snapshot that might vanish.
		os.Remove(dst)
		return Result{}, err
	}
	res.Duration = time.Since(start)
	return res, nil
}

func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	if err := d.Sync(); err != nil {
		return fmt.Errorf("sync %s: %w", dir, err)
	}
	return nil
}
