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

// Command pause is the test cluster's sandbox ("pause") image: it waits
// for SIGTERM or SIGINT and exits, reaping orphans meanwhile as PID 1 must.
package main

import "github.com/mpnbd/mpnbd/e2e/cluster/internal/reaper"

func main() { reaper.Run() }
