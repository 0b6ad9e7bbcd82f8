# ferry: the two set-up commands.
#   make run   - install missing Debian packages, build, then a short tour of the main jobs:
#                `ferry info`, `bench io`, `bench gds`, a tiny `kv bench`, `moe gen` + `moe replay`
#   make test  - the same set-up, then every test (CTest)
BUILD ?= build
CMAKE_FLAGS ?=
JOBS ?= $(shell nproc)

.PHONY: all deps build run test clean
all: build

deps:
	@scripts/deps.sh

build: deps
	cmake -S . -B $(BUILD) $(CMAKE_FLAGS)
	cmake --build $(BUILD) -j $(JOBS)

run: build
	@set -e; dir=$${RUN_DIR:-$$(mktemp -d -p /var/tmp ferry-run-XXXXXX)}; \
	trap 'rm -rf "$$dir"' EXIT; \
	set -x; \
	$(BUILD)/ferry info --dir "$$dir"; \
	$(BUILD)/ferry bench io --engine all --size 256M --chunk 8M --depth 8 --dir "$$dir"; \
	$(BUILD)/ferry bench gds --size 256M --chunk 32M --rounds 2 --alloc-ops 1000000 --dir "$$dir"; \
	$(BUILD)/ferry kv bench --model tiny --docs 4 --doc-tokens 2048 --questions 16 --l1 8M \
	  --dir "$$dir/kv" --create --l2 32M; \
	$(BUILD)/ferry moe gen --model small --tokens 256 -o "$$dir/moe_trace.jsonl"; \
	$(BUILD)/ferry moe replay "$$dir/moe_trace.jsonl" --slots 25% --policy routing

test: build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS) --timeout 600

clean:
	rm -rf $(BUILD)
