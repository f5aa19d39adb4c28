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

// Package repo finds the repository's root and builds the driver's
// commands, for the tests, end-to-end suites and tools that run the real
// binaries. The e2e suites are a module of their own (e2e/go.mod); Root
// is the driver's module's directory whichever of the two the working
// directory is in.
package repo

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
)

// Module is the driver's module path.
const Module = "github.com/mpnbd/mpnbd"

// Root returns the repository's root directory: the nearest directory
// above the working directory whose go.mod declares Module (not the e2e
// module, github.com/mpnbd/mpnbd/e2e, in its e2e directory).
func Root() (string, error) {
	dir, err := os.Getwd()
	if err != nil {
		return "", err
	}
	for {
		if b, err := os.ReadFile(filepath.Join(dir, "go.mod")); err == nil && declares(b, Module) {
			return dir, nil
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", errors.New("cannot find the mpnbd module root above the working directory")
		}
		dir = parent
	}
}

// declares reports whether the go.mod file gomod declares module path.
func declares(gomod []byte, path string) bool {
	for line := range bytes.Lines(gomod) {
		f := strings.Fields(string(line))
		if len(f) == 2 && f[0] == "module" && strings.Trim(f[1], `"`) == path {
			return true
		}
	}
	return false
}

// Commands are the driver's commands, as the manifests run them, and the
// operator's tool.
var Commands = []string{"controller", "node", "nbd-server", "mpnbdctl"}

// BuildCommands builds Commands as static binaries into dir, in the
// driver's module.
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
