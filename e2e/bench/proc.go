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
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
)

// userHZ is the unit of the time fields in /proc/PID/stat (USER_HZ,
// 100 on every Linux architecture the project runs on).
const userHZ = 100

// ProcStat holds the fields of /proc/PID/stat the benchmark uses.
type ProcStat struct {
	PID   int
	Comm  string
	State byte
	PPID  int
	// CPU time in clock ticks (USER_HZ): of the process itself (all its
	// threads) and of its children that exited and were waited for.
	UTime, STime, CUTime, CSTime uint64
}

// CPUSeconds is the process's own user+system time plus that of its
// waited-for children, in seconds.
func (s ProcStat) CPUSeconds() float64 {
	return float64(s.UTime+s.STime+s.CUTime+s.CSTime) / userHZ
}

// ParseProcStat parses the contents of /proc/PID/stat. The command name
// is in parentheses and may itself contain spaces and parentheses, so the
// fields are counted from the last ')'.
func ParseProcStat(b []byte) (ProcStat, error) {
	var s ProcStat
	str := strings.TrimSpace(string(b))
	open := strings.IndexByte(str, '(')
	closing := strings.LastIndexByte(str, ')')
	if open < 0 || closing < open {
		return s, fmt.Errorf("malformed /proc stat line %q", str)
	}
	pid, err := strconv.Atoi(strings.TrimSpace(str[:open]))
	if err != nil {
		return s, fmt.Errorf("malformed pid in /proc stat line: %w", err)
	}
	s.PID, s.Comm = pid, str[open+1:closing]
	// rest[0] is field 3 (state) of proc(5).
	rest := strings.Fields(str[closing+1:])
	if len(rest) < 15 {
		return s, fmt.Errorf("short /proc stat line (%d fields after the name)", len(rest))
	}
	s.State = rest[0][0]
	if s.PPID, err = strconv.Atoi(rest[1]); err != nil {
		return s, fmt.Errorf("ppid: %w", err)
	}
	for i, dst := range []*uint64{&s.UTime, &s.STime, &s.CUTime, &s.CSTime} {
		// utime is field 14, i.e. rest[11].
		v, err := strconv.ParseInt(rest[11+i], 10, 64)
		if err != nil {
			return s, fmt.Errorf("field %d: %w", 14+i, err)
		}
		if v > 0 {
			*dst = uint64(v)
		}
	}
	return s, nil
}

// ReadProcStat reads /proc/PID/stat.
func ReadProcStat(pid int) (ProcStat, error) {
	b, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "stat"))
	if err != nil {
		return ProcStat{}, err
	}
	return ParseProcStat(b)
}

// allProcs reads the stat of every process.
func allProcs() []ProcStat {
	ents, err := os.ReadDir("/proc")
	if err != nil {
		return nil
	}
	var out []ProcStat
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		if s, err := ReadProcStat(pid); err == nil {
			out = append(out, s)
		}
	}
	return out
}

// Descendants returns the processes below pid in the parent tree formed
// by procs (not pid itself).
func Descendants(procs []ProcStat, pid int) []ProcStat {
	children := map[int][]ProcStat{}
	for _, p := range procs {
		children[p.PPID] = append(children[p.PPID], p)
	}
	var out []ProcStat
	queue := []int{pid}
	seen := map[int]bool{pid: true}
	for len(queue) > 0 {
		p := queue[0]
		queue = queue[1:]
		for _, c := range children[p] {
			if !seen[c.PID] {
				seen[c.PID] = true
				out = append(out, c)
				queue = append(queue, c.PID)
			}
		}
	}
	return out
}

// TreeCPU returns the CPU seconds used by pid, its live descendants
// (e.g. nbd-server's per-connection children) and the descendants that
// already exited and were reaped (their time is in the parents' cutime
// and cstime).
func TreeCPU(pid int) (float64, error) {
	// The descendants are read before the process itself: a child reaped
	// in between is then counted twice rather than not at all. The
	// benchmark samples between runs, when connections are closed.
	procs := allProcs()
	var sum float64
	for _, d := range Descendants(procs, pid) {
		sum += d.CPUSeconds()
	}
	self, err := ReadProcStat(pid)
	if err != nil {
		return 0, err
	}
	return sum + self.CPUSeconds(), nil
}

// CPUJiffies returns the busy time of all CPUs (user, nice, system, irq,
// softirq, steal) and their whole time (with idle and iowait) from the
// first line of /proc/stat, in USER_HZ ticks.
func CPUJiffies() (busy, total uint64, err error) {
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		return 0, 0, err
	}
	line, _, _ := strings.Cut(string(b), "\n")
	f := strings.Fields(line)
	if len(f) < 9 || f[0] != "cpu" {
		return 0, 0, fmt.Errorf("/proc/stat: unexpected first line %q", line)
	}
	for i := 1; i <= 8; i++ { // user nice system idle iowait irq softirq steal
		v, err := strconv.ParseUint(f[i], 10, 64)
		if err != nil {
			return 0, 0, fmt.Errorf("/proc/stat: %q: %v", line, err)
		}
		total += v
		if i != 4 && i != 5 {
			busy += v
		}
	}
	return busy, total, nil
}

// LinkBytes are the byte counters of one network interface.
type LinkBytes struct {
	RX, TX uint64
}

// ParseLinkStats parses `ip -s -j link show` and returns the counters of
// every interface except loopback.
func ParseLinkStats(b []byte) (map[string]LinkBytes, error) {
	var links []struct {
		Ifname    string     `json:"ifname"`
		LinkType  string     `json:"link_type"`
		Stats64   *linkStats `json:"stats64"`
		StatsJSON *linkStats `json:"stats"`
	}
	if err := json.Unmarshal(b, &links); err != nil {
		return nil, fmt.Errorf("parsing ip -s -j link: %w", err)
	}
	out := make(map[string]LinkBytes, len(links))
	for _, l := range links {
		if l.LinkType == "loopback" || l.Ifname == "lo" {
			continue
		}
		st := l.Stats64
		if st == nil {
			st = l.StatsJSON
		}
		if st == nil {
			return nil, fmt.Errorf("no statistics for %s (ip without -s?)", l.Ifname)
		}
		out[l.Ifname] = LinkBytes{RX: st.RX.Bytes, TX: st.TX.Bytes}
	}
	return out, nil
}

type linkStats struct {
	RX struct {
		Bytes uint64 `json:"bytes"`
	} `json:"rx"`
	TX struct {
		Bytes uint64 `json:"bytes"`
	} `json:"tx"`
}

// SumLinks adds the counters of all interfaces.
func SumLinks(m map[string]LinkBytes) LinkBytes {
	var s LinkBytes
	for _, v := range m {
		s.RX += v.RX
		s.TX += v.TX
	}
	return s
}
