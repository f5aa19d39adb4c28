//go:build !linux

package blockdev

import (
	"fmt"
	"os"
	"runtime"
)

func unsupported() error { return fmt.Errorf("%w (GOOS=%s)", ErrUnsupported, runtime.GOOS) }

// AttachLoop is only implemented on Linux.
func AttachLoop(path string, o LoopOptions) (string, error) { return "", unsupported() }

// AttachLoopFile is only implemented on Linux.
func AttachLoopFile(path string, o LoopOptions) (*os.File, error) { return nil, unsupported() }

// DetachLoop is only implemented on Linux.
func DetachLoop(dev string) error { return unsupported() }

// FindLoopByBackingFile is only implemented on Linux.
func FindLoopByBackingFile(path string) ([]string, error) { return nil, unsupported() }

// FindLoopByBackingInode is only implemented on Linux.
func FindLoopByBackingInode(dev, ino uint64) ([]string, error) { return nil, unsupported() }

// StatLoop is only implemented on Linux.
func StatLoop(dev string) (LoopStatus, error) { return LoopStatus{}, unsupported() }

// LoopSetCapacity is only implemented on Linux.
func LoopSetCapacity(dev string) error { return unsupported() }

// DeviceSize is only implemented on Linux.
func DeviceSize(dev string) (uint64, error) { return 0, unsupported() }

// LoopAvailable is only implemented on Linux.
func LoopAvailable() error { return unsupported() }

// StatQueue is only implemented on Linux.
func StatQueue(dev string) (QueueLimits, error) { return QueueLimits{}, unsupported() }

// SetQueueLimits is only implemented on Linux.
func SetQueueLimits(dev string, l QueueLimits) error { return unsupported() }
