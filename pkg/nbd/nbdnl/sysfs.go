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

package nbdnl

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"
)

const defaultSysRoot = "/sys"

// DevicePath returns the block device node of device index.
func DevicePath(index uint32) string {
	return fmt.Sprintf("/dev/nbd%d", index)
}

// Sysfs reads nbd device attributes below a sysfs mount. Its zero value
// reads /sys; the package-level functions use it.
type Sysfs struct {
	// Root is where sysfs is mounted; "" means /sys.
	Root string
}

func (s Sysfs) blockDir(index uint32) string {
	root := s.Root
	if root == "" {
		root = defaultSysRoot
	}
	return filepath.Join(root, "block", fmt.Sprintf("nbd%d", index))
}

// WaitReady waits until device index runs and has the given size, as
// WaitReady on Sysfs{} does.
func WaitReady(ctx context.Context, index uint32, size uint64) error {
	return Sysfs{}.WaitReady(ctx, index, size)
}

// Backend reads the backend identifier of device index from /sys.
func Backend(index uint32) (string, error) {
	return Sysfs{}.Backend(index)
}

// FindByBackend finds the device whose backend identifier is id in /sys.
func FindByBackend(id string) (uint32, bool, error) {
	return Sysfs{}.FindByBackend(id)
}

// WaitReady polls, with growing pauses, until block/nbd<index>/pid exists
// (the kernel started the device) and block/nbd<index>/size, in 512-byte
// sectors, equals size/512. It gives up when ctx ends, with an error that
// says what was still missing and wraps ctx.Err(); without a deadline or
// cancellation on ctx it may wait forever.
func (s Sysfs) WaitReady(ctx context.Context, index uint32, size uint64) error {
	const (
		firstPause = 5 * time.Millisecond
		maxPause   = 250 * time.Millisecond
	)
	pause := firstPause
	for {
		missing := s.readiness(index, size)
		if missing == "" {
			return nil
		}
		t := time.NewTimer(pause)
		select {
		case <-ctx.Done():
			t.Stop()
			return fmt.Errorf("nbdnl: nbd%d not ready: %s: %w", index, missing, ctx.Err())
		case <-t.C:
		}
		pause = min(2*pause, maxPause)
	}
}

// readiness returns what keeps device index from being ready, or "".
func (s Sysfs) readiness(index uint32, size uint64) string {
	dir := s.blockDir(index)
	if _, err := os.Stat(dir); err != nil {
		return fmt.Sprintf("no device (%v)", err)
	}
	if _, err := os.Stat(filepath.Join(dir, "pid")); err != nil {
		return fmt.Sprintf("device not started, no pid attribute (%v)", err)
	}
	b, err := os.ReadFile(filepath.Join(dir, "size"))
	if err != nil {
		return fmt.Sprintf("cannot read size (%v)", err)
	}
	sectors, err := strconv.ParseUint(strings.TrimSpace(string(b)), 10, 64)
	if err != nil {
		return fmt.Sprintf("cannot parse size %q (%v)", strings.TrimSpace(string(b)), err)
	}
	if sectors != size/512 {
		return fmt.Sprintf("size is %d bytes, want %d", sectors*512, size/512*512)
	}
	return ""
}

// Backend returns the backend identifier device index was connected with
// ("" when none was given). The attribute exists only while a device
// configured over netlink is connected; otherwise the error wraps
// fs.ErrNotExist.
func (s Sysfs) Backend(index uint32) (string, error) {
	b, err := os.ReadFile(filepath.Join(s.blockDir(index), "backend"))
	if err != nil {
		return "", fmt.Errorf("nbdnl: backend of nbd%d: %w", index, err)
	}
	return strings.TrimSuffix(string(b), "\n"), nil
}

// FindByBackend scans block/nbd*/backend for the identifier id and returns
// the lowest index that has it; false when no connected device has it.
func (s Sysfs) FindByBackend(id string) (uint32, bool, error) {
	if id == "" {
		return 0, false, errors.New("nbdnl: find by backend: empty identifier")
	}
	root := s.Root
	if root == "" {
		root = defaultSysRoot
	}
	entries, err := os.ReadDir(filepath.Join(root, "block"))
	if err != nil {
		return 0, false, fmt.Errorf("nbdnl: find by backend: %w", err)
	}
	var indexes []uint32
	for _, e := range entries {
		if index, ok := parseNBDName(e.Name()); ok {
			indexes = append(indexes, index)
		}
	}
	slices.Sort(indexes)
	for _, index := range indexes {
		backend, err := s.Backend(index)
		if errors.Is(err, fs.ErrNotExist) {
			continue // not connected, or torn down meanwhile
		}
		if err != nil {
			return 0, false, fmt.Errorf("nbdnl: find by backend: %w", err)
		}
		if backend == id {
			return index, true, nil
		}
	}
	return 0, false, nil
}

// parseNBDName parses "nbd<decimal>".
func parseNBDName(name string) (uint32, bool) {
	digits, ok := strings.CutPrefix(name, "nbd")
	if !ok || digits == "" || strings.TrimLeft(digits, "0123456789") != "" {
		return 0, false
	}
	n, err := strconv.ParseUint(digits, 10, 32)
	if err != nil {
		return 0, false
	}
	return uint32(n), true
}
