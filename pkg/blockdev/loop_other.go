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
