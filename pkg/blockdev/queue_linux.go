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

package blockdev

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

var errNotBlock = errors.New("not a block device")

// devSysfs returns /sys/dev/block/MAJOR:MINOR of the block device node dev
// and its device number.
func devSysfs(dev string) (string, uint64, error) {
	var st unix.Stat_t
	if err := unix.Stat(dev, &st); err != nil {
		return "", 0, fmt.Errorf("blockdev: stat %s: %w", dev, err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFBLK {
		return "", 0, fmt.Errorf("blockdev: %s: %w", dev, errNotBlock)
	}
	return fmt.Sprintf("/sys/dev/block/%d:%d", unix.Major(st.Rdev), unix.Minor(st.Rdev)), st.Rdev, nil
}

// queueDir returns the sysfs directory of the request queue of the block
// device node dev.
func queueDir(dev string) (string, error) {
	sys, _, err := devSysfs(dev)
	return filepath.Join(sys, "queue"), err
}

func readQueueKB(dir, name string) (uint32, error) {
	b, err := os.ReadFile(filepath.Join(dir, name))
	if err != nil {
		return 0, fmt.Errorf("blockdev: %w", err)
	}
	v, err := strconv.ParseUint(strings.TrimSpace(string(b)), 10, 32)
	if err != nil {
		return 0, fmt.Errorf("blockdev: %s/%s: %w", dir, name, err)
	}
	return uint32(v), nil
}

func writeQueueKB(dir, name string, v uint32) error {
	if err := os.WriteFile(filepath.Join(dir, name), []byte(strconv.FormatUint(uint64(v), 10)), 0); err != nil {
		return fmt.Errorf("blockdev: set %s to %d: %w", name, v, err)
	}
	return nil
}

// StatQueue reads the request queue settings of the block device dev.
func StatQueue(dev string) (QueueLimits, error) {
	dir, err := queueDir(dev)
	if err != nil {
		return QueueLimits{}, err
	}
	var l QueueLimits
	if l.MaxSectorsKB, err = readQueueKB(dir, "max_sectors_kb"); err != nil {
		return QueueLimits{}, err
	}
	if l.ReadAheadKB, err = readQueueKB(dir, "read_ahead_kb"); err != nil {
		return QueueLimits{}, err
	}
	return l, nil
}

// SetQueueLimits sets the request queue settings of the block device dev
// that l names (a zero field is left as it is). A MaxSectorsKB above what
// the device can take (max_hw_sectors_kb) is lowered to that. The kernel
// derives the readahead again whenever the queue's limits change (a loop
// device's on every bind, and on a new max_sectors_kb), so it is set last,
// and callers set both after binding.
func SetQueueLimits(dev string, l QueueLimits) error {
	dir, err := queueDir(dev)
	if err != nil {
		return err
	}
	if l.MaxSectorsKB > 0 {
		hw, err := readQueueKB(dir, "max_hw_sectors_kb")
		if err != nil {
			return err
		}
		if err := writeQueueKB(dir, "max_sectors_kb", min(l.MaxSectorsKB, hw)); err != nil {
			return err
		}
	}
	if l.ReadAheadKB > 0 {
		if err := writeQueueKB(dir, "read_ahead_kb", l.ReadAheadKB); err != nil {
			return err
		}
	}
	return nil
}
