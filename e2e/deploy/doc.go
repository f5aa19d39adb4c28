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

// Package deploy tests the driver's packaging: the Dockerfile, the
// kustomize tree in deploy/ and the Helm chart in charts/mpnbd. The tests
// render both (helm from hack/tools.sh, `kubectl kustomize`), compare
// them, check every argument our commands get against the commands' own
// flags, and apply everything with a server-side dry run against a real
// API server (internal/testenv/apiserver). The chart's monitoring is checked against
// the code: its alerts with promtool (check rules, and the unit tests of
// testdata/prometheus-rules.test.yaml), and every query of the alerts
// and the Grafana dashboard against the metrics and labels the code
// exports.
//
// Tools that cannot be had (helm, kubectl, promtool) skip the tests,
// unless MPNBD_DEPLOY_REQUIRE=1 (hack/test.sh sets it as root), in which
// case they fail.
package deploy
