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
// right before it reads the source for the point it claims, and the resume
// function once it has finished reading it, whether it succeeded or not.
//
// How long writes are held depends on the method, and Result.Held reports
// it:
//
//   - reflink: the clone is a metadata operation, milliseconds even for a
//     large file, so holding writes around it is invisible to clients;
//   - copy with change tracking (WithChanges, which needs WithQuiesce):
//     the data is copied while writes flow and the source's changes are
//     recorded meanwhile. The ranges changed during the copy are copied
//     again, still with writes flowing, for a few rounds, until a round
//     finds little changed. The source is then synced without holding
//     anything, and only then held: Quiesce, copy again what changed
//     since the last round, take the source's size, resume. Writes wait
//     for a flush and a copy of what changed in the last moments, not for
//     the copy of the volume. A range copied again is first punched out of
//     the snapshot, so that what became a hole in the source is a hole in
//     the snapshot too. Before it holds writes for a reflink, Clone tries
//     to share the source's first block, without holding anything: where
//     the filesystem refuses that (ext4), writes are held only once, at
//     the end of the copy;
//   - copy without change tracking: the source is read with writes held
//     for the whole copy, seconds per GiB of data.
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
	// Copied is the bytes of data copied (0 for a reflink), Recopied
	// included.
	Copied int64
	// Recopied is the part of Copied that was copied again because the
	// source changed meanwhile (only with WithChanges).
	Recopied int64
	// Allocated is the space the destination uses on disk (st_blocks*512),
	// shared extents included.
	Allocated int64
	// Held is how long writes were held: from calling Quiesce to calling
	// its resume function, added up over the holds (0 without a Quiesce
	// hook).
	Held time.Duration
	// Duration is the whole Clone, syncs included.
	Duration time.Duration
}

// Option changes how Clone works.
type Option func(*options)

type options struct {
	quiesce   func(ctx context.Context) (resume func(), err error)
	changes   func() (take func() []Range, stop func())
	noReflink bool
	chunk     int64
	maxSize   int64
}

// Range is a byte range [Off, Off+Len) of the source.
type Range struct{ Off, Len int64 }

// WithQuiesce makes Clone call quiesce before it reads the source for the
// point the snapshot claims and the function quiesce returns once it has
// finished reading it (see the package documentation for what quiesce must
// do, and when it is called more than once). A nil resume is allowed; an
// error ends the Clone with it, nothing made.
func WithQuiesce(quiesce func(ctx context.Context) (resume func(), err error)) Option {
	return func(o *options) { o.quiesce = quiesce }
}

// WithChanges lets Clone copy the source while writes flow (see the
// package documentation). start begins recording the ranges of the source
// that change; take returns those changed since start or since the
// previous take, and stop ends the recording. take must report every
// change that was not in the source when the previous take returned, and
// under Quiesce every change not reported yet. Ranges may overlap and
// reach past the end of the source. It has no effect without WithQuiesce,
// nor on a reflink.
func WithChanges(start func() (take func() []Range, stop func())) Option {
	return func(o *options) { o.changes = start }
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

// WithMaxSize makes Clone refuse a source larger than n bytes with a
// *TooLargeError, before it copies anything when the source is larger
// already, and before the rename when it grew to that during the copy:
// nothing ever appears at dst.
func WithMaxSize(n int64) Option {
	return func(o *options) { o.maxSize = n }
}

// TooLargeError is Clone's refusal of a source larger than WithMaxSize.
type TooLargeError struct {
	Size, Max int64
}

func (e *TooLargeError) Error() string {
	return fmt.Sprintf("the source holds %d bytes, more than %d", e.Size, e.Max)
}

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
	} else if o.maxSize > 0 && fi.Size() > o.maxSize {
		return Result{}, &TooLargeError{Size: fi.Size(), Max: o.maxSize}
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
	h := &writeHold{quiesce: o.quiesce}
	err = func() error {
		defer h.release()
		return clone(ctx, in, out, &o, h, &res)
	}()
	if err != nil {
		return Result{}, err
	}
	res.Held = h.total
	if o.maxSize > 0 && res.Size > o.maxSize {
		return Result{}, &TooLargeError{Size: res.Size, Max: o.maxSize}
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

// writeHold holds the source's writes through the Quiesce hook and adds
// up how long they were held.
type writeHold struct {
	quiesce func(ctx context.Context) (resume func(), err error)
	resume  func()
	held    bool
	since   time.Time
	total   time.Duration
}

// hold quiesces the source, unless there is no hook or it is held already.
func (h *writeHold) hold(ctx context.Context) error {
	if h.quiesce == nil || h.held {
		return nil
	}
	since := time.Now()
	resume, err := h.quiesce(ctx)
	if err != nil {
		return fmt.Errorf("quiesce the source: %w", err)
	}
	h.resume, h.held, h.since = resume, true, since
	return nil
}

// release lets writes flow again if they are held.
func (h *writeHold) release() {
	if !h.held {
		return
	}
	if h.resume != nil {
		h.resume()
	}
	h.total += time.Since(h.since)
	h.resume, h.held = nil, false
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
