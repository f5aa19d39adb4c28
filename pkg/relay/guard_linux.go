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

package relay

import (
	"errors"
	"fmt"
	"os"
	"syscall"

	"golang.org/x/sys/unix"
)

// GuardAgainstReclaim protects a process that serves a kernel block device
// from deadlocking under memory pressure: if reclaim writes dirty pages to
// the device, the relay must make progress without itself waiting for
// reclaim. It tries each step and returns what it could not do (one
// wrapped error per step, joined), so the caller can log and go on:
//
//   - mlockall(MCL_CURRENT|MCL_FUTURE|MCL_ONFAULT): no page of the
//     process is swapped or dropped once used; pages mapped but not yet
//     used (a ublk queue's request buffers, the runtime's reservations)
//     are locked when first touched, not filled in ahead;
//   - prctl(PR_SET_IO_FLUSHER, 1) (Linux 5.6+, needs CAP_SYS_RESOURCE):
//     allocations of the relay's threads do not recurse into I/O, and the
//     block layer does not throttle them. The flag is per thread and
//     inherited by threads created later: it is set on every thread of the
//     process when the runtime allows that (no cgo), otherwise on the
//     calling thread only, which is reported. Call it early;
//   - oom_score_adj = -1000: the OOM killer leaves the process alone.
func GuardAgainstReclaim() error {
	var errs []error
	if err := unix.Mlockall(unix.MCL_CURRENT | unix.MCL_FUTURE | unix.MCL_ONFAULT); err != nil {
		errs = append(errs, fmt.Errorf("mlockall: %w", err))
	}
	if err := setIOFlusher(); err != nil {
		errs = append(errs, err)
	}
	if err := os.WriteFile("/proc/self/oom_score_adj", []byte("-1000\n"), 0); err != nil {
		errs = append(errs, fmt.Errorf("oom_score_adj -1000: %w", err))
	}
	return errors.Join(errs...)
}

func setIOFlusher() error {
	_, _, e := syscall.AllThreadsSyscall(unix.SYS_PRCTL, unix.PR_SET_IO_FLUSHER, 1, 0)
	if e == 0 {
		return nil
	}
	if e != syscall.ENOTSUP {
		// EINVAL: kernel older than 5.6; EPERM: no CAP_SYS_RESOURCE.
		return fmt.Errorf("prctl(PR_SET_IO_FLUSHER): %w", e)
	}
	// With cgo the runtime cannot reach every thread.
	if err := unix.Prctl(unix.PR_SET_IO_FLUSHER, 1, 0, 0, 0); err != nil {
		return fmt.Errorf("prctl(PR_SET_IO_FLUSHER): %w", err)
	}
	return fmt.Errorf("prctl(PR_SET_IO_FLUSHER): set on the calling thread only: %w", e)
}
