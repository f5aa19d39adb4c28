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
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"sigs.k8s.io/yaml"
)

// docFiles are the documents TestDocsNameWhatExists reads (globs, from
// the repository's root).
var docFiles = []string{"README.md", "docs/*.md", "charts/mpnbd/README.md"}

// externalFlags are the flags the documents name of programs other than
// ours, by program: a flag of ours that a document names must be one its
// command's --help lists; any other must be here.
var externalFlags = map[string][]string{
	"kubectl":             {"field-selector", "server-side", "force-conflicts", "selector", "previous", "show-labels"},
	"helm":                {"set", "set-json", "create-namespace", "no-hooks", "kube-version", "values", "namespace", "wait", "reuse-values", "keyring"},
	"gpg":                 {"export-secret-keys", "armor"},
	"skopeo, ctr":         {"all", "all-platforms"},
	"fio":                 {"verify", "size"},
	"CSI sidecars":        {"http-endpoint", "kube-api-qps", "feature-gates", "modify-timeout", "resize-timeout", "timeout", "extra-create-metadata", "leader-election"},
	"the Kubernetes e2e":  {"ginkgo"},
	"go test":             {"run", "count", "race", "timeout", "bench"},
	"kubelet, containerd": {"v"},
}

// notValues are dotted names the documents use that are no chart value
// on purpose, and what they are.
var notValues = map[string]string{
	"node.storageNic":        "the schema's example of a misspelt key it refuses",
	"datapath.sock.handover": "a socket file of the datapath",
}

// ourTools are the e2e module's commands the documents show with flags.
var ourTools = []string{"bench", "driverdemo", "nbdload", "topo"}

var (
	codeSpan   = regexp.MustCompile("`([^`\n]+)`")
	flagToken  = regexp.MustCompile(`(?:^|[\s(\[{=,])--([a-z][a-z0-9-]*)(\*?)`)
	valuesPath = regexp.MustCompile(`^[a-z][A-Za-z0-9]*(\.[A-Za-z][A-Za-z0-9]*)+$`)
	usageLine  = regexp.MustCompile(`^\s+mpnbdctl \[flags\] \[?([a-z][a-z-]*)`)
)

// docTexts returns the code of each document: its code spans and the
// lines of its fenced blocks, with where each comes from.
func docTexts(t *testing.T, root string) map[string][]string {
	t.Helper()
	out := map[string][]string{}
	for _, g := range docFiles {
		files, err := filepath.Glob(filepath.Join(root, g))
		if err != nil || len(files) == 0 {
			t.Fatalf("no document %s: %v", g, err)
		}
		for _, f := range files {
			b, err := os.ReadFile(f)
			if err != nil {
				t.Fatal(err)
			}
			rel, _ := filepath.Rel(root, f)
			fenced := false
			sc := bufio.NewScanner(bytes.NewReader(b))
			sc.Buffer(make([]byte, 0, 64<<10), 1<<20)
			for n := 1; sc.Scan(); n++ {
				line := sc.Text()
				if strings.HasPrefix(strings.TrimSpace(line), "```") {
					fenced = !fenced
					continue
				}
				where := fmt.Sprintf("%s:%d", rel, n)
				if fenced {
					out[where] = append(out[where], line)
					continue
				}
				for _, m := range codeSpan.FindAllStringSubmatch(line, -1) {
					out[where] = append(out[where], m[1])
				}
			}
		}
	}
	return out
}

// TestDocsNameWhatExists: every flag the documents name is one of our
// commands' (as its --help lists it) or another program's the test knows;
// a flag given to one of our commands in a command line is that command's;
// every mpnbdctl command they name exists; every chart value they name
// (a dotted path whose first part is a top-level value) is in values.yaml.
func TestDocsNameWhatExists(t *testing.T) {
	root := repoRoot(t)
	bins := commands(t)
	toolDir := t.TempDir()
	build := exec.Command("go", append([]string{"build", "-o", toolDir + "/"}, prefixed("./cmd/", ourTools)...)...)
	build.Dir = filepath.Join(root, "e2e")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("go build of the e2e commands: %v\n%s", err, out)
	}
	flagsOf := map[string]map[string]bool{}
	all := map[string]bool{}
	for _, c := range []string{"controller", "node", "nbd-server", "mpnbdctl"} {
		flagsOf[c] = flagNames(t, filepath.Join(bins, c))
	}
	for _, c := range ourTools {
		flagsOf[c] = toolFlags(t, filepath.Join(toolDir, c))
	}
	for _, fs := range flagsOf {
		for f := range fs {
			all[f] = true
		}
	}
	for _, fs := range externalFlags {
		for _, f := range fs {
			all[f] = true
		}
	}
	usage, err := exec.Command(filepath.Join(bins, "mpnbdctl"), "--help").Output()
	if err != nil {
		t.Fatal(err)
	}
	subcommands := map[string]bool{}
	for _, l := range strings.Split(string(usage), "\n") {
		if m := usageLine.FindStringSubmatch(l); m != nil {
			subcommands[m[1]] = true
		}
	}
	if !subcommands["drain"] || !subcommands["volumes"] {
		t.Fatalf("mpnbdctl's commands read from its usage: %v", subcommands)
	}
	vb, err := os.ReadFile(filepath.Join(root, "charts/mpnbd/values.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var values map[string]any
	if err := yaml.Unmarshal(vb, &values); err != nil {
		t.Fatal(err)
	}

	problems, checked := checkDocs(docTexts(t, root), docKnown{flagsOf: flagsOf, all: all, subcommands: subcommands, values: values})
	for _, p := range problems {
		t.Error(p)
	}
	if checked < 50 {
		t.Fatalf("checked only %d flags and values: the documents were not read as expected", checked)
	}

	// The check can fail: a misspelt command, another command's flag,
	// an unknown flag and an unknown value are found.
	bad := map[string][]string{"bad.md:1": {"mpnbdctl drian storage-1", "controller --lease-duration 6s", "--no-such-flag", "node.noSuchValue"}}
	if problems, _ := checkDocs(bad, docKnown{flagsOf: flagsOf, all: all, subcommands: subcommands, values: values}); len(problems) != 4 {
		t.Errorf("the check of made-up mistakes found %d, want 4: %q", len(problems), problems)
	}
}

// docKnown is what exists: each of our commands' flags, every flag the
// documents may name, mpnbdctl's commands and the chart's values.
type docKnown struct {
	flagsOf     map[string]map[string]bool
	all         map[string]bool
	subcommands map[string]bool
	values      map[string]any
}

// checkDocs checks the code of the documents against k; it returns the
// problems and how many flags and values it checked.
func checkDocs(docs map[string][]string, k docKnown) (problems []string, checked int) {
	flagsOf, all, subcommands, values := k.flagsOf, k.all, k.subcommands, k.values
	for where, texts := range docs {
		for _, text := range texts {
			for _, m := range flagToken.FindAllStringSubmatch(text, -1) {
				if m[2] != "" || strings.HasSuffix(m[1], "-") {
					continue // a family of flags: --max-*
				}
				checked++
				if !all[m[1]] {
					problems = append(problems, fmt.Sprintf("%s: --%s is no flag of our commands (nor of another program the test knows) in %q", where, m[1], text))
				}
			}
			for _, cmd := range commandLines(text) {
				fs := flagsOf[cmd.name]
				for _, f := range cmd.flags {
					if fs != nil && !fs[f] {
						problems = append(problems, fmt.Sprintf("%s: %s has no flag --%s (in %q)", where, cmd.name, f, text))
					}
				}
				if cmd.name == "mpnbdctl" && cmd.sub != "" && !subcommands[cmd.sub] {
					problems = append(problems, fmt.Sprintf("%s: mpnbdctl has no command %q (in %q)", where, cmd.sub, text))
				}
			}
			if valuesPath.MatchString(text) && notValues[text] == "" {
				parts := strings.Split(text, ".")
				if slices.Contains([]string{"com", "io", "org", "net"}, parts[len(parts)-1]) {
					continue // an API group or a domain
				}
				if _, top := values[parts[0]]; top {
					checked++
					if !hasValue(values, parts) {
						problems = append(problems, fmt.Sprintf("%s: the chart has no value %s", where, text))
					}
				}
			}
		}
	}
	return problems, checked
}

// commandLine is one of our commands in a document's code: its name, its
// first word (a command of mpnbdctl's) and the flags after it.
type commandLine struct {
	name, sub string
	flags     []string
}

// commandLines finds our commands in text ("mpnbdctl drain NODE --wait
// 0", "bin/nbd-server --listen ..."): each runs to a pipe, a semicolon,
// an && or the end.
func commandLines(text string) []commandLine {
	var out []commandLine
	for _, seg := range regexp.MustCompile(`\|\||&&|[|;]`).Split(text, -1) {
		words := strings.Fields(seg)
		for i, w := range words {
			name := filepath.Base(w)
			if w != name && !strings.HasPrefix(w, "bin/") && !strings.HasPrefix(w, "/usr/local/bin/") {
				continue
			}
			if !slices.Contains([]string{"controller", "node", "nbd-server", "mpnbdctl"}, name) || (i > 0 && name != "mpnbdctl" && name != "nbd-server") {
				continue
			}
			c := commandLine{name: name}
			for _, a := range words[i+1:] {
				switch {
				case strings.HasPrefix(a, "--"):
					f, _ := flagName(a)
					c.flags = append(c.flags, f)
				case c.sub == "" && len(c.flags) == 0 && regexp.MustCompile(`^[a-z][a-z-]+$`).MatchString(a):
					c.sub = a
				}
			}
			out = append(out, c)
			break
		}
	}
	return out
}

// hasValue reports whether values holds the dotted path parts; a map
// that is a value of its own (labels, annotations: any key) or a list
// ends the walk.
func hasValue(values map[string]any, parts []string) bool {
	var cur any = values
	for _, p := range parts {
		m, ok := cur.(map[string]any)
		if !ok {
			return true
		}
		next, ok := m[p]
		if !ok {
			return len(m) == 0
		}
		cur = next
	}
	return true
}

func prefixed(prefix string, names []string) []string {
	out := make([]string, len(names))
	for i, n := range names {
		out[i] = prefix + n
	}
	return out
}

// toolFlags lists the flags of an e2e command from its -h output (the
// flag package's default usage: "  -name type").
func toolFlags(t *testing.T, bin string) map[string]bool {
	t.Helper()
	out, _ := exec.Command(bin, "-h").CombinedOutput()
	names := map[string]bool{}
	for _, m := range regexp.MustCompile(`(?m)^\s+-{1,2}([a-z][a-z0-9-]*)`).FindAllStringSubmatch(string(out), -1) {
		names[m[1]] = true
	}
	if len(names) == 0 {
		t.Fatalf("%s -h lists no flags:\n%s", bin, out)
	}
	return names
}
