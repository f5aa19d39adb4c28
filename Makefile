GO      ?= go
BIN     := bin
CMDS    := nbd-server controller node

.PHONY: all build test bench demo deps clean

all: build

build:
	$(GO) build -o $(BIN)/ $(addprefix ./cmd/,$(CMDS))

deps:
	bash hack/install-deps.sh

test:
	bash hack/test.sh

bench: deps build
	bash hack/bench.sh

demo: deps build
	bash hack/demo.sh

clean:
	rm -rf $(BIN) out
