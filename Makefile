# ferry: the two set-up commands.
#   make run   - install missing Debian packages, build, run `ferry info`, short `bench io` and `bench gds`
#   make test  - the same set-up, then every test (CTest)
BUILD ?= build
CMAKE_FLAGS ?=
JOBS ?= $(shell nproc)
RUN_DIR ?= $(shell mktemp -d -p /var/tmp ferry-run-XXXXXX)

.PHONY: all deps build run test clean
all: build

deps:
	@scripts/deps.sh

build: deps
	cmake -S . -B $(BUILD) $(CMAKE_FLAGS)
	cmake --build $(BUILD) -j $(JOBS)

run: build
	$(BUILD)/ferry info --dir $(RUN_DIR)
	$(BUILD)/ferry bench io --engine all --size 256M --chunk 8M --depth 8 --dir $(RUN_DIR)
	$(BUILD)/ferry bench gds --size 256M --chunk 32M --rounds 2 --alloc-ops 1000000 --dir $(RUN_DIR)
	rm -rf $(RUN_DIR)

test: build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS) --timeout 600

clean:
	rm -rf $(BUILD)
