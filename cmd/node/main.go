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

// Command node is the CSI node plugin: the Identity and Node services of
// the driver, run on every node by a privileged DaemonSet. It attaches
// volumes with the transports the node has (the kernel's nbd driver through
// netlink, or FUSE and a loop device), formats, mounts and publishes them,
// and keeps the MPTCP subflow endpoints of the storage NICs. Run it with
// --help for the flags.
package main

import (
	"context"
	"os"
	"os/signal"
	"syscall"

	"github.com/mpnbd/mpnbd/pkg/attach/fuse"
	"github.com/mpnbd/mpnbd/pkg/attach/ublkdev"
)

func main() {
	// A volume's FUSE server process is this executable started again;
	// it must not do anything else first.
	if fuse.ServeRequested() {
		os.Exit(fuse.ServeMain())
	}
	// So is a ublk volume's server process.
	if ublkdev.ServeRequested() {
		os.Exit(ublkdev.ServeMain())
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}
