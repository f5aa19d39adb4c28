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

package attach

import (
	"errors"
	"os"
	"time"
)

// SelfPidfd is Linux only: without it no other process takes a silence of
// this one for its death.
func SelfPidfd() (*os.File, error) { return nil, errors.New("attach: pidfds are Linux only") }

// PidfdExitedBy cannot tell without a pidfd: never.
func PidfdExitedBy(*os.File, time.Time) bool { return false }
