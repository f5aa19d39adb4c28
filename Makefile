GO      ?= go
BIN     := bin
CMDS    := nbd-server controller node mpnbdctl

.PHONY: all build test soak bench bench-vm demo deps clean release

all: build

build:
	$(GO) build -o $(BIN)/ $(addprefix ./cmd/,$(CMDS))

deps:
	bash hack/install-deps.sh

test:
	bash hack/test.sh

# The long fault runs: fio --verify under storage-server SIGKILLs for
# minutes, a 5-minute outage mid-write, 2000 power-loss crash points; and
# the cluster suite with 10, 25, 50 and 100 PVCs created, mounted and
# deleted at once (out/cluster-scale.json and .svg); every spec of
# Kubernetes' storage suites for external drivers but the Disruptive,
# Serial and Flaky ones.
soak: deps
	MPNBD_SOAK=1 RELAY_CRASH_POINTS=2000 go test -count=1 -timeout 60m -v -run 'Fault|Fuse|Crash' ./pkg/relay
	cd e2e && MPNBD_SOAK=1 go test -count=1 -timeout 60m -v -run 'Fault|Fuse|Crash' ./faults
	cd e2e && MPNBD_CLUSTER_REQUIRE=1 MPNBD_CLUSTER_SCALE=10,25,50,100 go test -count=1 -timeout 90m -v -run TestDriverOnCluster ./cluster
	cd e2e && MPNBD_CLUSTER_REQUIRE=1 MPNBD_NODES_ONLY=kube MPNBD_KUBE_STORAGE_FOCUS=all go test -count=1 -timeout 120m -v -run TestDriverOnNodes ./cluster
	bash hack/vm-kernel-mptcp.sh
	cd e2e && MPNBD_SOAK=1 MPNBD_VM_REQUIRE=1 MPNBD_VM_MPTCP_REQUIRE=1 \
	  MPNBD_VM_RUN='TestTransportsServerKills|TestTransportsLongOutage|TestTransportsSilentStorage|TestTransportsSilentPath|TestPluginRestartDuringOutage|TestServerStallPastRequestTimeout|TestReadoptHealthyDevices' \
	  go test -count=1 -timeout 150m -v -run 'TestNodeAttachInVM|TestNodeAttachMPTCPKernelInVM' ./nodeattach

bench: deps build
	bash hack/bench-relay.sh
	bash hack/bench-replica.sh
	bash hack/bench.sh
	bash hack/bench.sh --profile many
	bash hack/bench-snapshots.sh

# The transports side by side on /dev/nbdX in the VM (kernel, relay,
# multiconn, tcp); builds the VM kernel whose nbd accepts MPTCP (cached).
bench-vm: deps
	bash hack/bench-vm.sh

# The release under out/release: the image for linux/amd64 and linux/arm64
# as one OCI index, each image's SBOM, the chart, and their signatures
# (SIGNING_KEY=FILE, an OpenPGP secret key; a throwaway one without).
# VERSION defaults to the chart's. hack/verify-release.sh checks it.
release: deps
	bash hack/release.sh $(if $(VERSION),--version $(VERSION))

demo: deps build
	bash hack/demo.sh

clean:
	rm -rf $(BIN) out
