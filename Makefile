# chunkserve: the two commands a new user types are `make demo` and `make test`.
# Both set up a fresh Debian 12 machine first (scripts/bootstrap.sh, idempotent)
# and fetch the default model (scripts/fetch-model.sh).
BUILD ?= build
JOBS ?= 2
CMAKE_FLAGS ?=
PY ?= python3
# MODEL: a name from `scripts/fetch-model.sh --list` (fetched by `make model`), or
# the path of a model file or directory: `make demo MODEL=qwen2.5-coder-1.5b`.
MODEL ?= smollm2-135m
MODEL_PATH := $(shell python3 scripts/fetch_model.py --path $(MODEL))
# Debian's OpenBLAS 0.3.21 does not recognise the newest Xeons and falls back
# to its SSE3 kernels (4-5x slower GEMM). Name the kernel family the CPU can
# run, unless the environment already chose one.
OPENBLAS_CORETYPE ?= $(shell grep -qw avx512f /proc/cpuinfo 2>/dev/null && echo SkylakeX || \
                      (grep -qw avx2 /proc/cpuinfo 2>/dev/null && echo Haswell))
ifneq ($(OPENBLAS_CORETYPE),)
export OPENBLAS_CORETYPE
endif

.PHONY: all build bootstrap model test-models check test test-stress test-unit test-py asan-build test-asan test-serve-asan test-cluster-asan tsan-build test-cluster-tsan fuzz-long demo bench image clean format

all: build

bootstrap:
	@scripts/bootstrap.sh

build: bootstrap
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=RelWithDebInfo $(CMAKE_FLAGS) >/dev/null
	cmake --build $(BUILD) -j$(JOBS)

model:
	@scripts/fetch-model.sh $(MODEL)

# The tests need the default model, Qwen2.5-Coder-0.5B (K-quants) and Gemma-3-270M
# (SentencePiece; its architecture is refused at load for now) whatever MODEL is.
test-models:
	@scripts/fetch-model.sh smollm2-135m
	@scripts/fetch-model.sh qwen2.5-coder-0.5b
	@scripts/fetch-model.sh gemma3-270m

# The fast lane for the edit-test loop (about a minute on 2 cores): the default
# build's unit tests (CTest label unit: every module's C tests, the CUDA backend
# under its emulator). `make test` stays the full suite that CI runs.
check: build
	cd $(BUILD) && ctest --output-on-failure -j$(JOBS) -L unit

# CTest (unit tests, and the cluster: real router + worker processes, label cluster),
# the unit tests and the tiny-model server and router tests again in an ASan+UBSan
# build, then the other process-level tests (pytest).
test: build model test-models
	cd $(BUILD) && ctest --output-on-failure -j$(JOBS)
	$(MAKE) --no-print-directory test-asan
	$(MAKE) --no-print-directory test-serve-asan
	$(MAKE) --no-print-directory test-cluster-asan
	CHUNKSERVE_BIN_DIR=$(abspath $(BUILD))/bin CHUNKSERVE_MODEL=$(abspath $(MODEL_PATH)) \
	  $(PY) -m pytest -q -m "not cluster and not emu and not chaos and not deploy" tests/py

asan-build: bootstrap
	cmake -S . -B $(BUILD)-asan -DCMAKE_BUILD_TYPE=Debug -DCS_SANITIZE=ON -DCS_CUDA=OFF -DCS_FAULT_INJECTION=ON >/dev/null
	cmake --build $(BUILD)-asan -j$(JOBS)

test-asan: asan-build
	cd $(BUILD)-asan && ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
	  ctest --output-on-failure -j$(JOBS) -L unit

# The tiny-model part of the pytest suite against the ASan build's `chunkserve serve`
# (incl. a burst of 1,000 malformed messages): the server must exit 0 with no report;
# `chunkserve bench serve` and `tune` as clients too.
test-serve-asan: asan-build
	CHUNKSERVE_BIN_DIR=$(abspath $(BUILD))-asan/bin ASAN_OPTIONS=detect_leaks=1:exitcode=23 \
	  UBSAN_OPTIONS=print_stacktrace=1 $(PY) -m pytest -q -m tiny tests/py/test_serve.py tests/py/test_openai.py \
	  tests/py/test_bench_serve.py

# The router in front of real chunkserve-prefill / -decode processes on the tiny model
# (tests/py/test_router.py: kill -9, SIGSTOP, restarts, cancellation, SIGTERM) against the
# ASan build: every process must exit 0 on SIGTERM (-9 only where a test killed it) with
# no sanitizer report on its stderr (leaks exit 23).
test-cluster-asan: asan-build
	CHUNKSERVE_BIN_DIR=$(abspath $(BUILD))-asan/bin ASAN_OPTIONS=detect_leaks=1:exitcode=23 \
	  UBSAN_OPTIONS=print_stacktrace=1 $(PY) -m pytest -q tests/py/test_router.py

# Not part of `make test` (it would double its time): the router and the
# workers under ThreadSanitizer, driven by the router tests (tiny model).
tsan-build: bootstrap
	cmake -S . -B $(BUILD)-tsan -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCS_CUDA=OFF \
	  -DCMAKE_C_FLAGS="-fsanitize=thread -fno-omit-frame-pointer" -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=thread" >/dev/null
	cmake --build $(BUILD)-tsan -j$(JOBS) --target chunkserve chunkserve-mktiny chunkserve-router chunkserve-prefill chunkserve-decode

test-cluster-tsan: tsan-build
	CHUNKSERVE_BIN_DIR=$(abspath $(BUILD))-tsan/bin TSAN_OPTIONS="halt_on_error=0 suppressions=$(abspath tests/tsan.supp)" \
	  $(PY) -m pytest -q tests/py/test_router.py

# `make test` under load, as on a shared machine: STRESS_HOGS busy loops (default 2,
# one per core of a CI machine) run beside it, STRESS_RUNS times (default 2). Tests
# assert correctness, never timing: every one must pass here too. Not part of
# `make test` (each run takes about twice as long).
STRESS_HOGS ?= 2
STRESS_RUNS ?= 2
test-stress:
	@hogs=""; for i in $$(seq $(STRESS_HOGS)); do (while :; do :; done) & hogs="$$hogs $$!"; done; \
	trap 'kill $$hogs 2>/dev/null' EXIT INT TERM; \
	for run in $$(seq $(STRESS_RUNS)); do \
	  echo "== test-stress: run $$run of $(STRESS_RUNS), $(STRESS_HOGS) busy loops beside it"; \
	  $(MAKE) --no-print-directory test || exit 1; \
	done

# Not part of `make test`: every libFuzzer driver (tests/fuzz, tests/kvx; built by
# `make build` where clang's libFuzzer works) for FUZZ_SECONDS each, one at a time,
# on scratch corpora under $(BUILD)/test-tmp/fuzz-long; prints executions and the
# final cov/ft per target and fails on any crash or UBSan report. FUZZ_TARGETS picks
# some (e.g. "gguf wire"). docs/security.md (Fuzzing) has the figures.
FUZZ_SECONDS ?= 300
FUZZ_TARGETS ?=
fuzz-long: build
	tests/fuzz/fuzz-long.sh $(BUILD) $(FUZZ_SECONDS) $(FUZZ_TARGETS)

demo: build model
	@scripts/demo.sh $(BUILD)/bin $(MODEL_PATH)

bench: build model
	$(PY) bench/bench_single.py --bin $(BUILD)/bin/chunkserve --model $(MODEL_PATH)

# The CPU container image (deploy/docker/Dockerfile.cpu) built without a Docker daemon
# (buildah, on a Debian 12 base made with debootstrap), then checked from inside: ldd,
# --help, a 1+1 cluster answering a gRPC request. Needs root; storage in /var/tmp/cs-image.
image: model
	CS_IMAGE_MODEL=$(MODEL_PATH) deploy/docker/build-image.sh

format:
	clang-format -i $$(git ls-files '*.c' '*.h' '*.cu' '*.cuh' '*.cpp' | grep -v unicode_tables.c)

clean:
	rm -rf $(BUILD) $(BUILD)-asan
