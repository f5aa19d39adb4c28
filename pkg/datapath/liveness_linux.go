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

package datapath

import (
	"errors"
	"os"
	"time"

	"golang.org/x/sys/unix"
)

// selfPidfd is a pidfd of this process, for a successor to learn of its
// exit: unlike a pid it means this process in any pid namespace (the
// successor runs in another pod) and cannot come to mean another one.
func selfPidfd() (*os.File, error) {
	fd, err := unix.PidfdOpen(os.Getpid(), 0)
	if err != nil {
		return nil, err
	}
	return os.NewFile(uintptr(fd), "pidfd"), nil
}

// exitedWithin reports whether the process of pidfd f has exited, waiting
// up to d for it: a pidfd polls readable once its process has exited.
func exitedWithin(f *os.File, d time.Duration) bool {
	if f == nil {
		return false
	}
	deadline := time.Now().Add(d)
	for {
		ms := max(int(time.Until(deadline)/time.Millisecond), 0)
		fds := []unix.PollFd{{Fd: int32(f.Fd()), Events: unix.POLLIN}}
		n, err := unix.Poll(fds, ms)
		switch {
		case errors.Is(err, unix.EINTR):
			if time.Now().After(deadline) {
				return false
			}
			continue
		case err != nil:
			return false
		}
		return n > 0 && fds[0].Revents&unix.POLLIN != 0
	}
}
