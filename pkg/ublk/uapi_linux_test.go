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

package ublk

import (
	"testing"
	"unsafe"
)

// TestUAPILayout checks the structs the driver reads and writes against
// the sizes and offsets of include/uapi/linux/ublk_cmd.h.
func TestUAPILayout(t *testing.T) {
	var (
		cc ctrlCmd
		di devInfo
		id ioDesc
		ic ioCmd
		pb paramBasic
		pd paramDiscard
		p  params
	)
	for _, c := range []struct {
		name      string
		got, want uintptr
	}{
		{"sizeof(ublksrv_ctrl_cmd)", unsafe.Sizeof(cc), 32},
		{"ublksrv_ctrl_cmd.addr", unsafe.Offsetof(cc.addr), 8},
		{"ublksrv_ctrl_cmd.dev_path_len", unsafe.Offsetof(cc.devPathLen), 24},

		{"sizeof(ublksrv_ctrl_dev_info)", unsafe.Sizeof(di), 64},
		{"ublksrv_ctrl_dev_info.state", unsafe.Offsetof(di.state), 4},
		{"ublksrv_ctrl_dev_info.max_io_buf_bytes", unsafe.Offsetof(di.maxIOBufBytes), 8},
		{"ublksrv_ctrl_dev_info.ublksrv_pid", unsafe.Offsetof(di.ublksrvPID), 16},
		{"ublksrv_ctrl_dev_info.flags", unsafe.Offsetof(di.flags), 24},

		{"sizeof(ublksrv_io_desc)", unsafe.Sizeof(id), 24},
		{"ublksrv_io_desc.start_sector", unsafe.Offsetof(id.startSector), 8},
		{"ublksrv_io_desc.addr", unsafe.Offsetof(id.addr), 16},

		{"sizeof(ublksrv_io_cmd)", unsafe.Sizeof(ic), 16},
		{"ublksrv_io_cmd.addr", unsafe.Offsetof(ic.addr), 8},

		{"sizeof(ublk_param_basic)", unsafe.Sizeof(pb), 32},
		{"ublk_param_basic.max_sectors", unsafe.Offsetof(pb.maxSectors), 8},
		{"ublk_param_basic.dev_sectors", unsafe.Offsetof(pb.devSectors), 16},

		{"sizeof(ublk_param_discard)", unsafe.Sizeof(pd), 20},
		{"ublk_param_discard.discard_granularity", unsafe.Offsetof(pd.discardGranularity), 4},
		{"ublk_param_discard.max_discard_segments", unsafe.Offsetof(pd.maxDiscardSegments), 16},

		{"ublk_params.basic", unsafe.Offsetof(p.basic), 8},
		{"ublk_params.discard", unsafe.Offsetof(p.discard), 40},
	} {
		if c.got != c.want {
			t.Errorf("%s = %d, want %d", c.name, c.got, c.want)
		}
	}
}
