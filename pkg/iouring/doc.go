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

// Package iouring is the small part of Linux io_uring that the ublk
// transport needs: a ring set up with io_uring_setup (optionally with
// 128-byte submission entries, whose last 80 bytes carry a driver
// command), its submission and completion queues mapped from the kernel,
// and io_uring_enter to submit and wait. A ring is not safe for concurrent
// use: one goroutine owns it (ublk runs one ring per queue). Memory the
// kernel reads or writes after a submission returns must not be Go stack
// memory; callers use mmap'd buffers. Only Linux has it.
package iouring
