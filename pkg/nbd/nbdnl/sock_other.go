//go:build !linux

package nbdnl

import (
	"errors"
	"os"
)

func socketProtocol(*os.File) (int, error) { return 0, errors.ErrUnsupported }
