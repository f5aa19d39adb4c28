//go:build !linux

package datapath

import (
	"errors"
	"os"
	"time"
)

// selfPidfd is Linux only: without it a successor never takes a silence
// of this process for its death.
func selfPidfd() (*os.File, error) { return nil, errors.New("datapath: pidfds are Linux only") }

// exitedWithin cannot tell without a pidfd: never.
func exitedWithin(*os.File, time.Duration) bool { return false }
