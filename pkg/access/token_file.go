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

package access

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
)

// LoadOrCreateToken returns the node's token kept in path, making one (and
// the file, readable by its owner only) when there is none. The token
// must outlive the node plugin: the publications on the API server carry
// its hash, and the data paths of attached volumes redial with it.
func LoadOrCreateToken(path string) (string, error) {
	b, err := os.ReadFile(path)
	switch {
	case err == nil:
		tok := strings.TrimSpace(string(b))
		if !ValidToken(tok) {
			return "", fmt.Errorf("access: %s holds no valid token (delete it to make a new one; volumes published to this node then need publishing again)", path)
		}
		return tok, nil
	case !errors.Is(err, fs.ErrNotExist):
		return "", fmt.Errorf("access: reading the node token: %w", err)
	}
	tok, err := NewToken()
	if err != nil {
		return "", err
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return "", fmt.Errorf("access: node token directory: %w", err)
	}
	tmp, err := os.CreateTemp(filepath.Dir(path), ".token-*")
	if err != nil {
		return "", fmt.Errorf("access: node token: %w", err)
	}
	defer os.Remove(tmp.Name())
	if _, err := tmp.WriteString(tok + "\n"); err != nil {
		tmp.Close()
		return "", fmt.Errorf("access: node token: %w", err)
	}
	if err := tmp.Sync(); err != nil {
		tmp.Close()
		return "", fmt.Errorf("access: node token: %w", err)
	}
	if err := tmp.Close(); err != nil {
		return "", fmt.Errorf("access: node token: %w", err)
	}
	// A link, not a rename: of two starting at once, the second finds
	// the first's file and takes its token.
	if err := os.Link(tmp.Name(), path); err != nil {
		if errors.Is(err, fs.ErrExist) {
			return LoadOrCreateToken(path)
		}
		return "", fmt.Errorf("access: node token: %w", err)
	}
	return tok, nil
}
