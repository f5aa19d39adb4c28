GO      ?= go
BIN     := bin
CMDS    := nbd-server controller node

.PHONY: all build test bench bench-vm demo deps clean

all: build

build:
	$(GO) build -o $(BIN)/ $(addprefix ./cmd/,$(CMDS))

deps:
	bash hack/install-deps.sh

test:
	bash hack/test.sh

bench: deps build
	bash hack/bench.sh

# The transports side by side on /dev/nbdX in the VM (kernel, relay,
# multiconn, tcp); builds the VM kernel whose nbd accepts MPTCP (cached).
bench-vm: deps
	bash hack/bench-vm.sh

demo: deps build
	bash hack/demo.sh

clean:
	rm -rf $(BIN) out
