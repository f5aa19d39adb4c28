#!/usr/bin/env bash
# Regenerates deepcopy code and the CRD manifests (the one source of truth
# for the chart and the kustomize tree) from api/.
set -euo pipefail
cd "$(dirname "$0")/.."
CONTROLLER_GEN=${CONTROLLER_GEN:-sigs.k8s.io/controller-tools/cmd/controller-gen@v0.20.1}
go run "$CONTROLLER_GEN" object:headerFile=hack/boilerplate.go.txt paths=./api/...
go run "$CONTROLLER_GEN" crd paths=./api/... output:crd:dir=deploy/crds
# The Helm chart ships the same CRD files, templated by
# templates/crds.yaml so that helm upgrade applies them (e2e/deploy checks
# they match).
rm -f charts/mpnbd/files/crds/*.yaml
cp deploy/crds/*.yaml charts/mpnbd/files/crds/
