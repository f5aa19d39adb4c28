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

package attach

import (
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// ProcFields returns the fields of /proc/PID/stat that follow the
// command name, the state first (field 3 of proc(5) is ProcFields[0]).
func ProcFields(pid int) ([]string, error) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return nil, err
	}
	// The command name, in parentheses, may hold anything.
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	if i < 0 || i+2 > len(s) {
		return nil, fmt.Errorf("/proc/%d/stat: unexpected format", pid)
	}
	f := strings.Fields(s[i+2:])
	if len(f) < 20 || f[0] == "" {
		return nil, fmt.Errorf("/proc/%d/stat: unexpected format", pid)
	}
	return f, nil
}

// ProcStat returns a process's state letter and start time (in clock ticks
// since boot: with the PID, what tells a process from a later one that
// reuses its PID).
func ProcStat(pid int) (state byte, start uint64, err error) {
	f, err := ProcFields(pid)
	if err != nil {
		return 0, 0, err
	}
	start, err = strconv.ParseUint(f[19], 10, 64)
	if err != nil {
		return 0, 0, fmt.Errorf("/proc/%d/stat: %w", pid, err)
	}
	return f[0][0], start, nil
}

// ProcAlive reports whether process pid runs (a zombie does not) and, if
// start is not 0, is the one that started then.
func ProcAlive(pid int, start uint64) bool {
	if pid <= 0 {
		return false
	}
	state, s, err := ProcStat(pid)
	if err != nil || state == 'Z' || state == 'X' {
		return false
	}
	return start == 0 || s == start
}

// SelfPidfd is a pidfd of this process, for another process to learn of
// its exit: unlike a pid it means this process in any pid namespace (a
// successor in another pod) and cannot come to mean another one.
func SelfPidfd() (*os.File, error) {
	fd, err := unix.PidfdOpen(os.Getpid(), 0)
	if err != nil {
		return nil, err
	}
	return os.NewFile(uintptr(fd), "pidfd"), nil
}

// PidfdExitedBy reports whether the process of pidfd f (nil: none known)
// has exited by deadline: a pidfd polls readable once its process has
// exited.
func PidfdExitedBy(f *os.File, deadline time.Time) bool {
	if f == nil {
		return false
	}
	raw, err := f.SyscallConn()
	if err != nil {
		return false
	}
	for {
		ms := max(int(time.Until(deadline)/time.Millisecond), 0)
		var n int
		var perr error
		var revents int16
		if err := raw.Control(func(fd uintptr) {
			fds := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
			n, perr = unix.Poll(fds, ms)
			revents = fds[0].Revents
		}); err != nil {
			return false
		}
		if errors.Is(perr, unix.EINTR) && time.Now().Before(deadline) {
			continue
		}
		return perr == nil && n > 0 && revents&unix.POLLIN != 0
	}
}
