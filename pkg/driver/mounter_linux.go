package driver

import (
	"errors"
	"fmt"
	"io/fs"
	"os"

	"golang.org/x/sys/unix"
	mount "k8s.io/mount-utils"
	utilexec "k8s.io/utils/exec"

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
	return m.resizer.Resize(devicePath, mountPath)
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
