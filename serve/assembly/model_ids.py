"""Models named by id: `python -m serve --model BAAI/bge-base-en-v1.5` (repeatable; `NAME=ID`, `ID@REVISION`, a
checkpoint or export directory, then the model's own export options if it needs any, e.g. `rr=Qwen/Qwen3-Reranker-0.6B
--reranker-template qwen3`; `--models-file` lists them one per line, for compose and k8s).

Before the server listens, each model is resolved (model/hub.py: huggingface_hub's cache, HF_HUB_OFFLINE,
HF_TOKEN) and, unless it already is an export, looked up in the export cache (model/export_cache.py,
`--export-cache`): found, it is served as it is (the server's own checks of its files, as for any export);
missing, it is exported first by the exporter's own process (`python -m export --from-pretrained`, its progress
lines in this server's output), under the cache's lock, so two servers starting at once export once. The
models are then served as a repository of links (`<cache>/served/<names and entries>/NAME -> entry`).

With --model-repository too, the repository's model folders (as they are at start) are served beside them, in
the same repository of links: compose and k8s set both, the export volume and MODEL_IDS. A name in both is refused.

All or nothing: a model that cannot be resolved or exported stops the start with one line naming it, the cache
and what to do (ModelSourceError); no model is served without the others. serve/ never imports torch: a server
installed without the exporter (no torch) says which job fills the cache (`--prepare-only`, where the export
extra is installed: the export image). `--prepare-only` runs from `python -m serve` before anything of the server
is imported (serve/__main__.py): this module needs huggingface_hub and model/, not gRPC or the generated code.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import importlib.util
import json
import logging
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

from model.export_cache import ExportCache, checkpoint_files, default_root
from model.export_format import METADATA_FILE, ExportError, read_metadata, repository_folders
from model.hub import HubError, ModelSpec, Resolved, parse_spec, resolve
from serve import logs
from serve.config import ServerConfig

log = logging.getLogger("serve.models")



class ModelSourceError(ValueError):
    """A model named by id or directory that cannot be served; one line."""


def specs_of(config: ServerConfig) -> list[ModelSpec]:
    """--model (comma-joined when repeated) and --models-file (one per line; blank lines and # comments skipped)."""
    texts = [t for t in config.model.split(",") if t.strip()]
    if config.models_file:
        try:
            lines = Path(config.models_file).read_text().splitlines()
        except OSError as error:
            raise ModelSourceError(f"models_file {config.models_file}: {error.strerror}") from None
        texts += [line.split("#", 1)[0] for line in lines if line.split("#", 1)[0].strip()]
    try:
        specs = [parse_spec(text) for text in texts]
    except HubError as error:
        raise ModelSourceError(str(error)) from None
    names = collections.Counter(spec.name for spec in specs)
    twice = sorted(name for name, count in names.items() if count > 1)
    if twice:
        raise ModelSourceError(f"model name {', '.join(twice)} given twice; name them apart: NAME=ID")
    return specs


def export_options(config: ServerConfig) -> list[str]:
    """The exporter's options for this server (part of the cache key): --export-graphs, else none (the
    exporter's own --graphs default, which has its one home there). Not fp16 by default, even for CUDA: the
    exporter refuses it for rotary models (Qwen, Llama, ModernBERT, ...) and a model id does not say its family
    before it is exported; `--graph auto` serves the optimized graph on CUDA then."""
    return ["--graphs", config.export_graphs] if config.export_graphs else []


def run_exporter(directory: Path, options: list[str], out_dir: Path, name: str, what: str) -> None:
    """`python -m export --from-pretrained DIRECTORY` as a process of its own; its progress lines go to this
    server's output as they come. A failure raises ModelSourceError with the exporter's last line."""
    command = [sys.executable, "-m", "export", "--from-pretrained", str(directory), "--out-dir", str(out_dir),
               "--name", name, *options]
    logs.event(log, "export_started", model=what, checkpoint=str(directory))
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    last = collections.deque(maxlen=3)
    for line in process.stdout:
        sys.stderr.write(f"[export {what}] {line}")
        if line.strip():
            last.append(line.strip())
    if process.wait() != 0:
        reason = last[-1] if last else f"exit {process.returncode}"
        raise ModelSourceError(f"model {what}: the export failed: {reason}")


def _validation_line(export_dir: Path) -> str:
    """The export's parity proof, graph by graph (GraphEntry.proof_line)."""
    try:
        graphs = read_metadata(export_dir).graphs
    except ExportError as error:
        return f"unreadable metadata: {error}"
    return "; ".join(f"{name} {entry.proof_line()}" for name, entry in graphs.items())


def export_of(spec: ModelSpec, resolved: Resolved, cache: ExportCache, options: list[str]) -> tuple[Path, str]:
    """(the export to serve for a resolved model, where it came from: "given" (the source is an export), "hit" (the
    export cache had it) or "exported" (by this start))."""
    if (resolved.directory / METADATA_FILE).is_file():  # already an export: served as it is
        if spec.options:
            raise ModelSourceError(f"model {spec.name} ({spec.source}) is an export already: the export options "
                                   f"{shlex.join(spec.options)} apply to a checkpoint; give them to its export")
        return resolved.directory, "given"
    options = [*options, *spec.options]  # the model's own after the server's: an option given twice, the model's
    what = f"{spec.name} ({spec.source}{'@' + spec.revision if spec.revision else ''})"
    source = {"source": spec.source, "revision": spec.revision, "commit": resolved.commit}
    files = checkpoint_files(resolved.directory)  # hashed once: a directory's weights are read whole
    if cache.lookup(files, options) is None and importlib.util.find_spec("torch") is None:
        raise ModelSourceError(
            f"model {what} is not in the export cache {cache.root} and this installation cannot export (no torch: "
            "the export extra); fill the cache where it is installed (the export image: `docker compose --profile "
            "export run --rm export` with the same MODEL_IDS, or `pip install '.[export]'`): python -m serve "
            f"--prepare-only true --model {shlex.quote(shlex.join([spec.source, *spec.options]))} "
            f"--export-cache {cache.root}")
    export, exported = cache.get(files, options, source,
                                 lambda out_dir, name: run_exporter(resolved.directory, options, out_dir, name, what))
    return export, "exported" if exported else "hit"


def served_repository(root: Path, exports: dict[str, Path]) -> Path:
    """A repository folder of links NAME -> export, one per set of (name, export); made whole, then renamed."""
    digest = hashlib.sha256(json.dumps({n: str(p) for n, p in sorted(exports.items())}).encode()).hexdigest()[:16]
    repository = root / "served" / digest
    if repository.is_dir():
        return repository
    repository.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{digest}.", dir=repository.parent))
    for name, export in exports.items():
        os.symlink(export.resolve(), scratch / name)
    try:
        os.rename(scratch, repository)
    except OSError:  # made meanwhile by another server with the same models
        for link in scratch.iterdir():
            link.unlink()
        scratch.rmdir()
    return repository


def repository_models(config: ServerConfig, specs: list[ModelSpec]) -> dict[str, Path]:
    """The model folders of --model-repository, served beside the models by id (none without it)."""
    if not config.model_repository:
        return {}
    root = Path(config.model_repository)
    if not root.is_dir():
        raise ModelSourceError(f"model_repository {root}: not a folder")
    folders = repository_folders(root)
    clash = sorted(set(folders) & {spec.name for spec in specs})
    if clash:
        raise ModelSourceError(f"model name {', '.join(clash)} is both a folder of model_repository {root} and a "
                               "model by id; name the id apart: NAME=ID")
    return folders


def prepare(config: ServerConfig) -> ServerConfig:
    """The config to serve with: the models of --model / --models-file resolved, exported where needed, and
    served as a repository with the folders of --model-repository, if given (model_repository set to it; model,
    models_file and prepare_only cleared: what the front ends read is a repository). Unchanged without them."""
    specs = specs_of(config)
    if not specs:
        return config
    cache = ExportCache(Path(config.export_cache) if config.export_cache else default_root())
    options = export_options(config)
    exports = repository_models(config, specs)
    for spec in specs:
        try:
            resolved = resolve(spec.source, spec.revision)
        except HubError as error:
            raise ModelSourceError(str(error)) from None
        exports[spec.name], cached = export_of(spec, resolved, cache, options)
        logs.event(log, "model_source", model=spec.name, source=spec.source, revision=spec.revision or "",
                   commit=resolved.commit or "", export=str(exports[spec.name]), cache=cached,
                   validation=_validation_line(exports[spec.name]))
    repository = served_repository(cache.root, exports)
    return dataclasses.replace(config, model="", models_file="", prepare_only=False, model_repository=str(repository))


def prepare_only(config: ServerConfig) -> int:
    """`python -m serve --prepare-only true`: resolve and export the models into the cache, then exit (0; 1 with
    one line when a model cannot be)."""
    logs.setup(config.log_level)
    try:
        prepared = prepare(config)
    except ModelSourceError as error:
        logs.event(log, "startup_failed", logging.ERROR, error=str(error))
        return 1
    logs.event(log, "models_prepared", repository=prepared.model_repository)
    return 0
