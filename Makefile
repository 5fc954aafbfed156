# Two commands on a fresh machine (README Quickstart):
#   make run    set up, export the default encoder and the packaged MiniLM into the model repository
#               exports/ (skipping those already there), serve both: gRPC 127.0.0.1:50051, HTTP :8000
#   make test   set up, generate the protobuf code, build the native transport, run the whole test suite
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# export: torch + onnx (export host); serve: onnxruntime + grpc (CPU serving, no torch);
# minilm: the packaged real model; dev: test runner + grpcio-tools (the `proto` build step); reference:
# test-only reference implementations and clients.
EXTRAS ?= export,serve,minilm,dev,reference
PYTEST_ARGS ?=
# Two pytest-xdist workers, a test file each at a time (tests/parallel.py): the suite in about half its serial
# time on 2 cores. PYTEST_XDIST= runs it serially.
PYTEST_XDIST ?= -n 2 --dist loadfile
# The model repository `make run` serves: one export folder per model, served under the folder's name.
EXPORTS ?= exports
MINILM := all-minilm-l6-v2

.PHONY: setup proto native export run test bench clean

setup: $(VENV)/.installed

# With the reference extra, pinned and without their dependencies: PyLate, the ColBERT reference of
# tests/test_colbert.py (its pins, torch 2.11 / transformers 5.3 / sentence-transformers 5.3, would replace ours;
# what it imports besides them, datasets, is in the reference extra; tests/pylate_reference.py bridges it to ST 6),
# and FlagEmbedding, the bge-m3 reference of tests/test_bge_m3.py, with the two packages its import needs (peft,
# accelerate; its other dependencies, datasets aside, are for training: ir_datasets, sentencepiece, ...).
$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[$(EXTRAS)]'
	case ',$(EXTRAS),' in *,reference,*) $(BIN)/python -m pip install -q --no-deps 'pylate==1.6.0' \
	    'FlagEmbedding==1.4.2' 'peft==0.21.2' 'accelerate==1.15.0';; esac
	touch $@

proto: setup
	$(BIN)/python -m tools.protogen

# The native gRPC transport (serve/transport/native.py) is C++ on gRPC C++ from Debian; its package
# list lives in tools/native_build.py, which installs it (as root with apt) when missing. Elsewhere
# the build says what is missing and the server runs on the grpcio transport. In CI it must build.
native: setup
	$(BIN)/python -m tools.native_build --install-deps $(if $(CI),--require)

export: $(EXPORTS)/default/metadata.json $(EXPORTS)/$(MINILM)/metadata.json

# One export per model, each written once: the exporter renames a finished export into place, so its
# metadata.json exists only once the whole export does. To export one again, delete its folder first.
$(EXPORTS)/default/metadata.json: | setup
	$(BIN)/python -m export --out-dir $(EXPORTS) --name default

$(EXPORTS)/$(MINILM)/metadata.json: | setup
	$(BIN)/python -m export --minilm --out-dir $(EXPORTS) --name $(MINILM)

# Every model of the repository, by its folder name; a call that names no model gets `default`.
run: export proto native
	$(BIN)/python -m serve --model-repository $(EXPORTS) --default-model default

test: setup proto native
	$(BIN)/python -m pytest $(PYTEST_XDIST) $(PYTEST_ARGS)

bench: setup proto
	$(BIN)/python -m bench

clean:
	rm -rf exports bench-results serve/_proto serve/_native .pytest_cache .hypothesis
