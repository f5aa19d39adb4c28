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

package driver

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
	mount "k8s.io/mount-utils"
	utilexec "k8s.io/utils/exec"

	"github.com/mpnbd/mpnbd/internal/capability"
	"github.com/mpnbd/mpnbd/pkg/blockdev"
)

// mounter is the real Mounter: mount-utils for mounting, formatting and
// resizing, plain system calls for the rest.
type mounter struct {
	*mount.SafeFormatAndMount
	resizer *mount.ResizeFs
}

// NewMounter returns the Mounter of this host.
func NewMounter() Mounter {
	e := utilexec.New()
	return &mounter{
		SafeFormatAndMount: mount.NewSafeFormatAndMount(mount.New(""), e),
		resizer:            mount.NewResizeFs(e),
	}
}

func (m *mounter) PathExists(path string) (bool, error) { return mount.PathExists(path) }

func (m *mounter) MakeDir(path string) error { return os.MkdirAll(path, 0o750) }

func (m *mounter) MakeFile(path string) error {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_RDONLY, 0o640)
	if err != nil {
		return err
	}
	return f.Close()
}

func (m *mounter) IsBlockDevice(path string) (bool, error) {
	fi, err := os.Stat(path)
	if err != nil {
		return false, err
	}
	return fi.Mode()&fs.ModeDevice != 0 && fi.Mode()&fs.ModeCharDevice == 0, nil
}

func (m *mounter) GetDeviceSize(path string) (uint64, error) { return blockdev.DeviceSize(path) }

func (m *mounter) DeviceFromMount(mountPath string) (string, error) {
	dev, refs, err := mount.GetDeviceNameFromMount(m.Interface, mountPath)
	if err != nil {
		return "", err
	}
	if dev == "" || refs == 0 {
		return "", fmt.Errorf("%w: nothing mounted at %s", ErrNotFound, mountPath)
	}
	return dev, nil
}

func (m *mounter) Resize(devicePath, mountPath string) (bool, error) {
	// Only when the device is larger than the filesystem: a stage calls
	// this every time.
	need, err := m.resizer.NeedResize(devicePath, mountPath)
	if err != nil || !need {
		return false, err
	}
	ok, err := m.resizer.Resize(devicePath, mountPath)
	if err != nil {
		if format, _ := m.GetDiskFormat(devicePath); strings.HasPrefix(format, "ext") && !capability.Has(capability.Effective, capability.SysResource) {
			// The kernel's online resize of ext4 (EXT4_IOC_RESIZE_FS)
			// needs CAP_SYS_RESOURCE; resize2fs then only says
			// "Permission denied".
			return false, fmt.Errorf("%w: growing a mounted %s file system needs CAP_SYS_RESOURCE, which this process does not have "+
				"(not in its capability bounding set: the container runtime or the host drops it); grant it to the node plugin, "+
				"or grow the volume offline (it grows at its next stage, once no pod uses it): %w", ErrPrecondition, format, err)
		}
	}
	return ok, err
}

// growSlack is how much smaller than its device an ext file system may be
// and still count as grown.
const growSlack = 16 << 20

// extSize is the size of the ext2/3/4 file system on devicePath, from its
// superblock (dumpe2fs -h).
func (m *mounter) extSize(devicePath string) (uint64, error) {
	out, err := m.Exec.Command("dumpe2fs", "-h", devicePath).CombinedOutput()
	if err != nil {
		return 0, fmt.Errorf("dumpe2fs -h %s: %w: %s", devicePath, err, out)
	}
	var blocks, size uint64
	for _, line := range strings.Split(string(out), "\n") {
		k, v, ok := strings.Cut(line, ":")
		if !ok {
			continue
		}
		switch strings.TrimSpace(k) {
		case "Block count":
			blocks, err = strconv.ParseUint(strings.TrimSpace(v), 10, 64)
		case "Block size":
			size, err = strconv.ParseUint(strings.TrimSpace(v), 10, 64)
		}
		if err != nil {
			return 0, fmt.Errorf("dumpe2fs -h %s: %q: %w", devicePath, line, err)
		}
	}
	if blocks == 0 || size == 0 {
		return 0, fmt.Errorf("dumpe2fs -h %s gave no block count and size: %s", devicePath, out)
	}
	return blocks * size, nil
}

func (m *mounter) GrowUnmounted(devicePath string) (bool, error) {
	format, err := m.GetDiskFormat(devicePath)
	if err != nil {
		return false, err
	}
	switch format {
	case "ext2", "ext3", "ext4":
	default:
		return false, nil // none yet, or one that grows mounted (xfs)
	}
	devSize, err := blockdev.DeviceSize(devicePath)
	if err != nil {
		return false, err
	}
	fsSize, err := m.extSize(devicePath)
	if err != nil {
		return false, err
	}
	// resize2fs leaves out a last block group too small to hold its own
	// metadata: a few MiB short of the device is as large as it gets.
	if devSize <= fsSize+growSlack {
		return false, nil
	}
	// resize2fs wants a file system checked since its last mount; a
	// restored one is a crash-consistent image whose journal e2fsck
	// replays. Exit status 1: errors corrected.
	out, err := m.Exec.Command("e2fsck", "-f", "-p", devicePath).CombinedOutput()
	if err != nil {
		var ee utilexec.ExitError
		if !errors.As(err, &ee) || ee.ExitStatus() != 1 {
			return false, fmt.Errorf("e2fsck -f -p %s: %w: %s", devicePath, err, out)
		}
	}
	if out, err := m.Exec.Command("resize2fs", devicePath).CombinedOutput(); err != nil {
		return false, fmt.Errorf("resize2fs %s: %w: %s", devicePath, err, out)
	}
	return true, nil
}

func (m *mounter) Statfs(path string) (FSStats, error) {
	var st unix.Statfs_t
	if err := unix.Statfs(path, &st); err != nil {
		if errors.Is(err, unix.ENOENT) {
			return FSStats{}, fmt.Errorf("%w: %s", ErrNotFound, path)
		}
		return FSStats{}, fmt.Errorf("statfs %s: %w", path, err)
	}
	bs := int64(st.Bsize)
	return FSStats{
		TotalBytes:     int64(st.Blocks) * bs,
		AvailableBytes: int64(st.Bavail) * bs,
		UsedBytes:      int64(st.Blocks-st.Bfree) * bs,
		TotalInodes:    int64(st.Files),
		FreeInodes:     int64(st.Ffree),
		UsedInodes:     int64(st.Files - st.Ffree),
	}, nil
}
