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

package bench

import (
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"
)

// FioArgs returns fio's arguments (after "fio") for workload w against
// the NBD URI, time based: ramp (unmeasured) then runtime. The report is
// JSON on standard output.
func FioArgs(w Workload, uri string, runtime, ramp time.Duration) []string {
	args := []string{
		"--output-format=json",
		"--name=" + w.Name,
		"--ioengine=nbd",
		"--uri=" + uri,
		"--rw=" + w.RW,
		"--bs=" + strconv.Itoa(w.BlockSize),
		"--iodepth=" + strconv.Itoa(w.QueueDepth),
		"--numjobs=1",
		"--time_based",
		"--runtime=" + fioDuration(runtime),
	}
	if ramp > 0 {
		args = append(args, "--ramp_time="+fioDuration(ramp))
	}
	if strings.HasPrefix(w.RW, "rand") {
		// No block bitmap: offsets are uniformly random like nbdload's.
		args = append(args, "--norandommap", "--randrepeat=0")
	}
	return args
}

// fioDuration formats d for fio's time options, in milliseconds.
func fioDuration(d time.Duration) string {
	return strconv.FormatInt(d.Milliseconds(), 10) + "ms"
}

// FioResult is what a fio run reported, summed over its jobs.
type FioResult struct {
	Jobs    int
	Error   int // first non-zero job error (an errno)
	Bytes   int64
	Ops     int64
	Seconds float64 // longest job runtime of the measured phase
	MBps    float64 // sum of the jobs' bandwidth, 10^6 bytes/s
	IOPS    float64
	// CPUSeconds is the CPU time fio reported for its jobs (usr+sys
	// percentages times the job runtime).
	CPUSeconds float64
}

type fioJSON struct {
	Jobs []struct {
		Name       string  `json:"jobname"`
		Error      int     `json:"error"`
		JobRuntime float64 `json:"job_runtime"` // ms
		UsrCPU     float64 `json:"usr_cpu"`     // percent
		SysCPU     float64 `json:"sys_cpu"`     // percent
		Read       fioDir  `json:"read"`
		Write      fioDir  `json:"write"`
	} `json:"jobs"`
}

type fioDir struct {
	IOBytes  int64   `json:"io_bytes"`
	BWBytes  float64 `json:"bw_bytes"`
	IOPS     float64 `json:"iops"`
	Runtime  float64 `json:"runtime"` // ms
	TotalIOs int64   `json:"total_ios"`
}

// ParseFio parses fio's --output-format=json report. Anything printed
// before the JSON object (fio's nbd engine announces its connection on
// standard output) is skipped.
func ParseFio(out []byte) (FioResult, error) {
	var r FioResult
	s := string(out)
	i := strings.Index(s, "{")
	if i < 0 {
		return r, errors.New("fio printed no JSON report")
	}
	var doc fioJSON
	if err := json.Unmarshal([]byte(s[i:]), &doc); err != nil {
		return r, fmt.Errorf("parsing fio JSON: %w", err)
	}
	if len(doc.Jobs) == 0 {
		return r, errors.New("fio report has no jobs")
	}
	r.Jobs = len(doc.Jobs)
	for _, j := range doc.Jobs {
		if j.Error != 0 && r.Error == 0 {
			r.Error = j.Error
		}
		for _, d := range []fioDir{j.Read, j.Write} {
			r.Bytes += d.IOBytes
			r.Ops += d.TotalIOs
			r.MBps += d.BWBytes / 1e6
			r.IOPS += d.IOPS
			r.Seconds = max(r.Seconds, d.Runtime/1000)
		}
		r.CPUSeconds += (j.UsrCPU + j.SysCPU) / 100 * j.JobRuntime / 1000
	}
	return r, nil
}
