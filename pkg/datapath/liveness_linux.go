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
