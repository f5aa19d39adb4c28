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

package main

import (
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/mpnbd/mpnbd/internal/testenv/topo"
)

// process is a command the demo started; its output goes to a log file.
type process struct {
	name    string
	cmd     *exec.Cmd
	logPath string
	logf    *os.File
	done    chan struct{}
	err     error // set once done is closed
	// reported is set once exited has returned the exit as an error.
	reported bool
}

// startProcess runs bin with args, inside network namespace ns unless ns
// is empty. It uses nsenter --net, which switches only the network
// namespace: the process shares the demo's mounts (ip netns exec would
// give it a private mount namespace, hiding what it mounts).
func startProcess(logDir, name, ns, bin string, args ...string) (*process, error) {
	logPath := filepath.Join(logDir, name+".log")
	logf, err := os.Create(logPath)
	if err != nil {
		return nil, err
	}
	argv := append([]string{bin}, args...)
	if ns != "" {
		argv = append([]string{"nsenter", "--net=/run/netns/" + ns, "--"}, argv...)
	}
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Stdout, cmd.Stderr = logf, logf
	// A process group of its own: a Ctrl-C at the terminal reaches only
	// the demo, which then tears things down in order.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		logf.Close()
		return nil, fmt.Errorf("starting %s: %w", name, err)
	}
	p := &process{name: name, cmd: cmd, logPath: logPath, logf: logf, done: make(chan struct{})}
	go func() {
		p.err = cmd.Wait()
		close(p.done)
	}()
	return p, nil
}

// exited reports an error when the process has ended already.
func (p *process) exited() error {
	select {
	case <-p.done:
		p.reported = true
		return fmt.Errorf("%s exited: %v; its log:\n%s", p.name, p.err, p.tail(30))
	default:
		return nil
	}
}

// stop ends the process: SIGTERM, then SIGKILL after grace. An exit
// caused by SIGTERM is not an error; a process that had to be killed is.
func (p *process) stop(grace time.Duration) error {
	defer p.logf.Close()
	select {
	case <-p.done:
		if p.reported {
			return nil
		}
		return fmt.Errorf("%s had exited before it was stopped: %v; its log:\n%s", p.name, p.err, p.tail(30))
	default:
	}
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
		var ee *exec.ExitError
		if p.err == nil || errors.As(p.err, &ee) && ee.ExitCode() == -1 {
			return nil // exited by itself or by the signal
		}
		return fmt.Errorf("%s: %v", p.name, p.err)
	case <-time.After(grace):
		_ = p.cmd.Process.Kill()
		<-p.done
		return fmt.Errorf("%s did not stop within %s of SIGTERM and was killed", p.name, grace)
	}
}

// tail returns the last lines of the process's log.
func (p *process) tail(lines int) string {
	b, err := os.ReadFile(p.logPath)
	if err != nil {
		return err.Error()
	}
	l := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
	if len(l) > lines {
		l = l[len(l)-lines:]
	}
	return "      | " + strings.Join(l, "\n      | ")
}

// forwarder accepts TCP connections on a listener inside a network
// namespace and connects each to an address dialled from the demo's own
// namespace: it lets the storage agent, which runs in the server
// namespace, reach the API server on the host's loopback.
type forwarder struct {
	l      net.Listener
	target string
	wg     sync.WaitGroup
	mu     sync.Mutex
	conns  map[net.Conn]bool
	closed bool
}

// newForwarder listens on 127.0.0.1 (a free port) in ns and forwards to
// target.
func newForwarder(ns, target string) (*forwarder, error) {
	f := &forwarder{target: target, conns: map[net.Conn]bool{}}
	err := topo.InNetns(ns, func() error {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		f.l = l
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("forwarder listener in %s: %w", ns, err)
	}
	f.wg.Add(1)
	go f.serve()
	return f, nil
}

// Port is the listener's port.
func (f *forwarder) Port() int { return f.l.Addr().(*net.TCPAddr).Port }

func (f *forwarder) track(c net.Conn, add bool) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	if add {
		if f.closed {
			return false
		}
		f.conns[c] = true
	} else {
		delete(f.conns, c)
	}
	return true
}

func (f *forwarder) serve() {
	defer f.wg.Done()
	for {
		in, err := f.l.Accept()
		if err != nil {
			return
		}
		f.wg.Add(1)
		go func() {
			defer f.wg.Done()
			defer in.Close()
			// This goroutine is not locked to a thread of the server
			// namespace: it dials from the demo's namespace.
			out, err := net.DialTimeout("tcp", f.target, 10*time.Second)
			if err != nil {
				return
			}
			defer out.Close()
			if !f.track(in, true) {
				return
			}
			defer f.track(in, false)
			f.track(out, true)
			defer f.track(out, false)
			done := make(chan struct{}, 2)
			pipe := func(dst, src net.Conn) {
				_, _ = io.Copy(dst, src)
				if tc, ok := dst.(*net.TCPConn); ok {
					_ = tc.CloseWrite()
				}
				done <- struct{}{}
			}
			go pipe(out, in)
			go pipe(in, out)
			<-done
			<-done
		}()
	}
}

// Close stops listening, closes every forwarded connection and waits
// for the goroutines.
func (f *forwarder) Close() error {
	err := f.l.Close()
	f.mu.Lock()
	f.closed = true
	for c := range f.conns {
		c.Close()
	}
	f.mu.Unlock()
	f.wg.Wait()
	return err
}

// netnsPIDs lists the processes in network namespace ns.
func netnsPIDs(ns string) ([]int, error) {
	out, err := exec.Command("ip", "netns", "pids", ns).Output()
	if err != nil {
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			return nil, fmt.Errorf("ip netns pids %s: %v: %s", ns, err, strings.TrimSpace(string(ee.Stderr)))
		}
		return nil, err
	}
	var pids []int
	for _, f := range strings.Fields(string(out)) {
		if pid, err := strconv.Atoi(f); err == nil {
			pids = append(pids, pid)
		}
	}
	return pids, nil
}
