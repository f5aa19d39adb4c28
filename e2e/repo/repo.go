// Package repo finds the module's root and builds its commands, for the
// end-to-end suites and tools that run the real binaries.
package repo

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
)

// Root returns the module's root directory: the nearest directory above
// the working directory whose go.mod declares this module.
func Root() (string, error) {
	dir, err := os.Getwd()
	if err != nil {
		return "", err
	}
	for {
		if b, err := os.ReadFile(filepath.Join(dir, "go.mod")); err == nil &&
			bytes.Contains(b, []byte("module github.com/mpnbd/mpnbd\n")) {
			return dir, nil
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", errors.New("cannot find the mpnbd module root above the working directory")
		}
		dir = parent
	}
}

// Commands are the driver's commands, as the manifests run them.
var Commands = []string{"controller", "node", "nbd-server"}

// BuildCommands builds Commands as static binaries into dir.
func BuildCommands(dir string) error {
	root, err := Root()
	if err != nil {
		return err
	}
	args := []string{"build", "-trimpath", "-o", dir + "/"}
	for _, c := range Commands {
		args = append(args, "./cmd/"+c)
	}
	cmd := exec.Command("go", args...)
	cmd.Dir = root
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("go build: %v\n%s", err, out)
	}
	return nil
}
