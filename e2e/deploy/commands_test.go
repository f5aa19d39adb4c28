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

package deploy

import (
	"bufio"
	"bytes"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"

	"github.com/mpnbd/mpnbd/internal/testenv/repo"
)

// ourBinDir is where the Dockerfile installs our commands.
const ourBinDir = "/usr/local/bin"

// container is one container of a rendered workload.
type container struct {
	workload string // kind/name
	name     string
	image    string
	command  []string
	args     []string
	env      map[string]string // name -> sample value
	podSpec  map[string]any
	spec     map[string]any
}

// fieldSamples are values for the downward API fields the manifests use.
var fieldSamples = map[string]string{
	"spec.nodeName":      "node-1",
	"metadata.namespace": "mpnbd-system",
	"metadata.name":      "mpnbd-pod",
	"status.hostIP":      "192.0.2.10",
	"status.hostIPs":     "192.0.2.10,2001:db8::10",
	"status.podIP":       "192.0.2.10",
	"metadata.labels['pod-template-generation']": "3",
}

// containers lists the containers of every workload in objs.
func containers(t testing.TB, objs []*unstructured.Unstructured) []container {
	t.Helper()
	var out []container
	for _, o := range objs {
		switch o.GetKind() {
		case "Deployment", "DaemonSet", "StatefulSet":
		default:
			continue
		}
		pod, ok, _ := unstructured.NestedMap(o.Object, "spec", "template", "spec")
		if !ok {
			t.Fatalf("%s %s has no pod spec", o.GetKind(), o.GetName())
		}
		list, _, _ := unstructured.NestedSlice(pod, "containers")
		for _, c := range list {
			m := c.(map[string]any)
			ct := container{workload: o.GetKind() + "/" + o.GetName(), env: map[string]string{}, podSpec: pod, spec: m}
			ct.name, _, _ = unstructured.NestedString(m, "name")
			ct.image, _, _ = unstructured.NestedString(m, "image")
			ct.command, _, _ = unstructured.NestedStringSlice(m, "command")
			ct.args, _, _ = unstructured.NestedStringSlice(m, "args")
			env, _, _ := unstructured.NestedSlice(m, "env")
			for _, e := range env {
				em := e.(map[string]any)
				name, _, _ := unstructured.NestedString(em, "name")
				if v, ok, _ := unstructured.NestedString(em, "value"); ok {
					ct.env[name] = v
					continue
				}
				field, _, _ := unstructured.NestedString(em, "valueFrom", "fieldRef", "fieldPath")
				sample, ok := fieldSamples[field]
				if !ok {
					t.Fatalf("%s container %s: env %s from unknown field %q", ct.workload, ct.name, name, field)
				}
				ct.env[name] = sample
			}
			out = append(out, ct)
		}
	}
	return out
}

// ours returns the containers that run one of our commands, by the
// command's name.
func ours(t testing.TB, cs []container) map[string][]container {
	t.Helper()
	out := map[string][]container{}
	for _, c := range cs {
		if len(c.command) == 0 || path.Dir(c.command[0]) != ourBinDir {
			if strings.Contains(c.image, "mpnbd/mpnbd") {
				t.Errorf("%s container %s runs our image without a %s/ command", c.workload, c.name, ourBinDir)
			}
			continue
		}
		if len(c.command) != 1 {
			t.Errorf("%s container %s: command %q: want the binary alone, flags in args", c.workload, c.name, c.command)
		}
		b := path.Base(c.command[0])
		out[b] = append(out[b], c)
	}
	return out
}

var varRef = regexp.MustCompile(`\$\(([A-Za-z_][A-Za-z0-9_]*)\)`)

// expand substitutes $(VAR) references the way the kubelet does; an
// unknown variable is an error (the kubelet would pass it on verbatim).
func expand(t testing.TB, c container, arg string) string {
	t.Helper()
	return varRef.ReplaceAllStringFunc(arg, func(ref string) string {
		name := varRef.FindStringSubmatch(ref)[1]
		v, ok := c.env[name]
		if !ok {
			t.Errorf("%s container %s: argument %q refers to $(%s), which is not in its env", c.workload, c.name, arg, name)
		}
		return v
	})
}

var (
	buildOnce sync.Once
	binDir    string
	buildErr  error
)

// commands builds cmd/controller, cmd/node and cmd/nbd-server once.
func commands(t testing.TB) string {
	t.Helper()
	buildOnce.Do(func() {
		binDir, buildErr = os.MkdirTemp("", "mpnbd-deploy-bin-")
		if buildErr != nil {
			return
		}
		buildErr = repo.BuildCommands(binDir)
	})
	if buildErr != nil {
		t.Fatal(buildErr)
	}
	return binDir
}

func TestMain(m *testing.M) {
	code := m.Run()
	if binDir != "" {
		os.RemoveAll(binDir)
	}
	os.Exit(code)
}

var helpFlag = regexp.MustCompile(`^\s+--?([a-z0-9][a-z0-9-]*)\b`)

// flagNames parses the flag names from a command's --help output.
func flagNames(t testing.TB, bin string) map[string]bool {
	t.Helper()
	out, err := exec.Command(bin, "--help").Output()
	if err != nil {
		t.Fatalf("%s --help: %v", bin, err)
	}
	names := map[string]bool{}
	sc := bufio.NewScanner(bytes.NewReader(out))
	inFlags := false
	for sc.Scan() {
		line := sc.Text()
		if line == "Flags:" {
			inFlags = true
			continue
		}
		if inFlags && line != "" && !strings.HasPrefix(line, " ") {
			break // the next section
		}
		if m := helpFlag.FindStringSubmatch(line); inFlags && m != nil {
			names[m[1]] = true
		}
	}
	if len(names) < 5 {
		t.Fatalf("%s --help: found only flags %v in:\n%s", bin, names, out)
	}
	return names
}

// flagName returns the name of a "--name[=value]" argument.
func flagName(arg string) (string, bool) {
	if !strings.HasPrefix(arg, "-") {
		return "", false
	}
	name := strings.TrimLeft(arg, "-")
	name, _, _ = strings.Cut(name, "=")
	return name, true
}

// checkCommandArgs checks every argument our commands get in objs: each is
// a flag the command's --help lists, and the command parses the whole
// argument list (with $(VAR)s expanded) without complaint.
func checkCommandArgs(t *testing.T, objs []*unstructured.Unstructured, wantCommands ...string) {
	bins := commands(t)
	byCmd := ours(t, containers(t, objs))
	var got []string
	for name := range byCmd {
		got = append(got, name)
	}
	slices.Sort(got)
	slices.Sort(wantCommands)
	if !slices.Equal(got, wantCommands) {
		t.Errorf("the manifests run %v of our commands, want %v", got, wantCommands)
	}
	for name, cs := range byCmd {
		bin := filepath.Join(bins, name)
		if _, err := os.Stat(bin); err != nil {
			t.Errorf("manifests run %s/%s, which is not a command of cmd/", ourBinDir, name)
			continue
		}
		flags := flagNames(t, bin)
		for _, c := range cs {
			var args []string
			for _, a := range c.args {
				n, ok := flagName(a)
				if !ok {
					t.Errorf("%s container %s: argument %q is not a --flag", c.workload, c.name, a)
					continue
				}
				if !flags[n] {
					t.Errorf("%s container %s: %s has no flag --%s (argument %q)", c.workload, c.name, name, n, a)
				}
				args = append(args, expand(t, c, a))
			}
			// The flag package parses up to --help and stops there: exit 0
			// means every argument before it parsed.
			cmd := exec.Command(bin, append(args, "--help")...)
			cmd.Env = os.Environ()
			for k, v := range c.env {
				cmd.Env = append(cmd.Env, k+"="+v)
			}
			if out, err := cmd.CombinedOutput(); err != nil {
				t.Errorf("%s container %s: %s %s --help: %v\n%s", c.workload, c.name, name,
					strings.Join(args, " "), err, firstLines(out, 5))
			}
		}
	}
}

func firstLines(b []byte, n int) string {
	lines := strings.SplitN(string(b), "\n", n+1)
	return strings.Join(lines[:min(n, len(lines))], "\n")
}

// TestKustomizeCommandArgs: the arguments deploy/ gives our commands are
// theirs.
func TestKustomizeCommandArgs(t *testing.T) {
	checkCommandArgs(t, parseObjects(t, kustomizeDeploy(t)), "controller", "node", "nbd-server")
}

// TestChartCommandArgs: likewise for the chart, with default and with
// non-default values (NICs, addresses, transports, ports...).
func TestChartCommandArgs(t *testing.T) {
	checkCommandArgs(t, parseObjects(t, helmTemplate(t)), "controller", "node", "nbd-server")
	checkCommandArgs(t, parseObjects(t, customTemplate(t)), "controller", "node", "nbd-server")
}

// TestCommandArgsCheckCanFail feeds the check an unknown flag and a bad
// value.
func TestCommandArgsCheckCanFail(t *testing.T) {
	bins := commands(t)
	flags := flagNames(t, filepath.Join(bins, "node"))
	for _, f := range []string{"storage-nic", "backup-nic", "endpoint", "state-dir"} {
		if !flags[f] {
			t.Errorf("node --help: flag %s not found in %v", f, flags)
		}
	}
	if flags["no-such-flag"] {
		t.Error("node --help lists no-such-flag")
	}
	for _, args := range [][]string{{"--no-such-flag"}, {"--storage-address=not-an-ip"}} {
		cmd := exec.Command(filepath.Join(bins, "node"), append(args, "--help")...)
		if err := cmd.Run(); err == nil {
			t.Errorf("node %v --help exited 0", args)
		}
	}
}

// dockerfileBuild returns the ./cmd/ packages the Dockerfile's go build
// compiles and the binaries its final stage copies to ourBinDir, and the
// final stage's base image and user.
func dockerfileBuild(t testing.TB) (built, copied []string, base, user string) {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(repoRoot(t), "Dockerfile"))
	if err != nil {
		t.Fatal(err)
	}
	// Join continuation lines, drop comments.
	var lines []string
	var cur strings.Builder
	for _, l := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(strings.TrimSpace(l), "#") {
			continue
		}
		if s, ok := strings.CutSuffix(l, "\\"); ok {
			cur.WriteString(s + " ")
			continue
		}
		cur.WriteString(l)
		lines = append(lines, strings.TrimSpace(cur.String()))
		cur.Reset()
	}
	args := map[string]string{}   // ARG defaults
	stages := map[string]string{} // a stage's name -> its base image
	for _, l := range lines {
		f := strings.Fields(l)
		if len(f) == 0 {
			continue
		}
		switch strings.ToUpper(f[0]) {
		case "ARG":
			for _, a := range f[1:] {
				if k, v, ok := strings.Cut(a, "="); ok {
					args[k] = v
				}
			}
		case "FROM":
			f = slices.DeleteFunc(f, func(w string) bool { return strings.HasPrefix(w, "--platform=") })
			base, user = os.Expand(f[1], func(k string) string { return args[k] }), "" // a new stage starts as root
			if b, ok := stages[base]; ok {
				base = b // FROM an earlier stage: its base
			}
			if len(f) == 4 && strings.EqualFold(f[2], "AS") {
				stages[f[3]] = base
			}
		case "USER":
			user = f[1]
		case "RUN":
			if !strings.Contains(l, "go build") {
				continue
			}
			if !strings.Contains(l, "CGO_ENABLED=0") || !strings.Contains(l, "-trimpath") {
				t.Errorf("Dockerfile: %q: want a static (CGO_ENABLED=0), -trimpath build", l)
			}
			for _, w := range f {
				if p, ok := strings.CutPrefix(w, "./cmd/"); ok {
					built = append(built, p)
				}
			}
		case "COPY":
			if len(f) < 3 || !strings.HasPrefix(f[1], "--from=") {
				continue
			}
			if dst := f[len(f)-1]; strings.TrimSuffix(dst, "/") != ourBinDir {
				continue
			}
			for _, src := range f[2 : len(f)-1] {
				copied = append(copied, path.Base(src))
			}
		}
	}
	return built, copied, base, user
}

// TestDockerfileBuildsEveryCommand: every command the manifests run is
// built and installed by the Dockerfile; the image runs as non-root unless
// a pod says otherwise, and only the node plugin and the storage agent do.
func TestDockerfileBuildsEveryCommand(t *testing.T) {
	built, copied, base, user := dockerfileBuild(t)
	if base != "debian:bookworm-slim" {
		t.Errorf("Dockerfile: final stage FROM %s, want debian:bookworm-slim", base)
	}
	if user != "65532" && !strings.HasPrefix(user, "65532:") {
		t.Errorf("Dockerfile: final USER %q, want 65532", user)
	}
	for _, objs := range [][]*unstructured.Unstructured{
		parseObjects(t, kustomizeDeploy(t)),
		parseObjects(t, helmTemplate(t)),
		parseObjects(t, customTemplate(t)),
	} {
		for name, cs := range ours(t, containers(t, objs)) {
			if !slices.Contains(built, name) || !slices.Contains(copied, name) {
				t.Errorf("manifests run %s; the Dockerfile builds %v and installs %v", name, built, copied)
			}
			if _, err := os.Stat(filepath.Join(repoRoot(t), "cmd", name, "main.go")); err != nil {
				t.Errorf("manifests run %s: %v", name, err)
			}
			for _, c := range cs {
				root := runAsUser(c) == 0
				if wantRoot := name != "controller"; root != wantRoot {
					t.Errorf("%s container %s: runs as root: %v, want %v", c.workload, c.name, root, wantRoot)
				}
				if name == "controller" {
					if nonRoot, _, _ := unstructured.NestedBool(c.podSpec, "securityContext", "runAsNonRoot"); !nonRoot {
						t.Errorf("%s: pod securityContext.runAsNonRoot is not true", c.workload)
					}
				} else if priv, _, _ := unstructured.NestedBool(c.spec, "securityContext", "privileged"); !priv {
					t.Errorf("%s container %s is not privileged", c.workload, c.name)
				}
			}
		}
	}
}

// runAsUser is the effective user of a container: its own setting, else
// the pod's, else the image's (65532).
func runAsUser(c container) int64 {
	for _, m := range []map[string]any{c.spec, c.podSpec} {
		v, ok, _ := unstructured.NestedFieldNoCopy(m, "securityContext", "runAsUser")
		if !ok {
			continue
		}
		switch n := v.(type) {
		case int64:
			return n
		case float64:
			return int64(n)
		}
	}
	return 65532
}
