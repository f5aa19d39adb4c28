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
