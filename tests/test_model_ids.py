"""Models named by id (issue 41): `python -m serve --model ORG/NAME[@REV]` and `python -m export --from-pretrained
ORG/NAME`, resolved by huggingface_hub from a real cache layout the tests make (tests/hub_cache.py) with
HF_HUB_OFFLINE=1, exported on first use into the export cache (model/export_cache.py) and reused after.

References: sentence-transformers' SentenceTransformer.encode and CrossEncoder.predict on the same snapshot
folders. The Hub itself cannot be reached here: its refusals (gated, unknown, no such revision) are the hub
library's own exception classes raised by a stand-in for snapshot_download, and say so."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.hub_cache import add_revision
from tests.subprocess_env import REPO, repo_env

EMBEDDER_ID = "sentence-transformers/all-MiniLM-L6-v2"
RERANKER_ID = "test-org/tiny-reranker"
QUERY = "What is deep learning?"
DOCUMENTS = ["Deep learning is machine learning with neural networks of many layers.",
             "Paris is the capital of France.", "Neural networks learn representations from data."]
TINY = dict(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
            max_position_embeddings=512)
FLAGS = ("--export-graphs", "fp32")  # one graph per export: what the tests need, in less time
MIN_COSINE = 0.99999
SCORE_ATOL = 1e-4


def _reranker_checkpoint(directory, seed):
    """A BERT cross-encoder (one logit) as transformers saves it, with MiniLM's tokenizer files; weights drawn
    from `seed` at a scale where scores differ between documents."""
    import shutil

    import torch
    from transformers import BertConfig, BertForSequenceClassification

    from model.hf_pretrained import minilm_path

    torch.manual_seed(seed)
    model = BertForSequenceClassification(BertConfig(**TINY, num_labels=1)).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(4.0) if parameter.dim() > 1 else None
    model.save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(minilm_path() / name, directory / name)
    return directory


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """{"cache": a Hugging Face cache holding MiniLM (main) and a tiny cross-encoder (main, and v2 with other
    weights), "snapshots": {id or id@ref: snapshot folder}}."""
    from model.hf_pretrained import minilm_path

    cache, work = tmp_path_factory.mktemp("hf-cache"), tmp_path_factory.mktemp("checkpoints")
    commits = {EMBEDDER_ID: add_revision(cache, EMBEDDER_ID, minilm_path()),
               RERANKER_ID: add_revision(cache, RERANKER_ID, _reranker_checkpoint(work / "rr-main", seed=0))}
    commits[f"{RERANKER_ID}@v2"] = add_revision(cache, RERANKER_ID, _reranker_checkpoint(work / "rr-v2", seed=1), "v2")
    snapshots = {spec: cache / f"models--{spec.split('@')[0].replace('/', '--')}" / "snapshots" / commit
                 for spec, commit in commits.items()}
    return {"cache": cache, "snapshots": snapshots}


def _offline(hub) -> dict[str, str]:
    return {"HF_HUB_CACHE": str(hub["cache"]), "HF_HUB_OFFLINE": "1", "HF_TOKEN": ""}


def _prepare(hub, export_cache, *models, env: dict[str, str] | None = None, **popen):
    """`python -m serve --prepare-only` for `models` (started, not waited for, when popen is given)."""
    command = [sys.executable, "-m", "serve", "--prepare-only", "true", "--export-cache", str(export_cache), *FLAGS,
               *[arg for model in models for arg in ("--model", model)]]
    env = {**repo_env(), **_offline(hub), **(env or {})}
    if popen:
        return subprocess.Popen(command, cwd=REPO, env=env, **popen)
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def _events(log: str, name: str) -> list[str]:
    return [line for line in log.splitlines() if f"event={name} " in line or line.endswith(f"event={name}")]


@pytest.fixture(scope="module")
def export_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("export-cache")


@pytest.fixture(scope="module")
def served(hub, export_cache, serve_start):
    """MiniLM and the cross-encoder (named rr) from their ids in one command, on an empty export cache."""
    return serve_start(REPO, "--model", EMBEDDER_ID, "--model", f"rr={RERANKER_ID}", "--export-cache",
                       str(export_cache), *FLAGS, env=_offline(hub), timeout=600)


def test_models_named_by_id_are_exported_on_first_use_and_served_together(served):
    log = served.log()
    sources = _events(log, "model_source")
    assert len(sources) == 2 and all("cache=exported" in line for line in sources)
    assert len(_events(log, "export_started")) == 2
    listed = httpx.get(f"http://127.0.0.1:{served.http_port}/v1/models", timeout=30).json()
    assert {m["id"] for m in listed["data"]} == {"all-minilm-l6-v2", "rr"}


def test_an_embedder_served_from_its_id_equals_sentence_transformers_on_its_snapshot(served, hub):
    from sentence_transformers import SentenceTransformer

    texts = ["The quick brown fox jumps over the lazy dog.", "Models by id, served in one command."]
    answer = httpx.post(f"http://127.0.0.1:{served.http_port}/v1/embeddings",
                        json={"model": "all-minilm-l6-v2", "input": texts}, timeout=60).json()
    ours = np.array([row["embedding"] for row in answer["data"]])
    reference = SentenceTransformer(str(hub["snapshots"][EMBEDDER_ID]), device="cpu").encode(texts)
    cosines = (ours * reference).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(reference, axis=1)
    assert cosines.min() >= MIN_COSINE


def test_a_cross_encoder_served_from_its_id_equals_cross_encoder_predict_on_its_snapshot(served, hub):
    from sentence_transformers import CrossEncoder

    answer = httpx.post(f"http://127.0.0.1:{served.http_port}/rerank",
                        json={"model": "rr", "query": QUERY, "texts": DOCUMENTS},
                        timeout=60).json()
    ours = {row["index"]: row["score"] for row in answer}
    reference = CrossEncoder(str(hub["snapshots"][RERANKER_ID]), device="cpu").predict([(QUERY, d) for d in DOCUMENTS])
    assert np.allclose([ours[i] for i in range(len(DOCUMENTS))], reference, atol=SCORE_ATOL)


def _proof_in_metadata(served, model):
    """{graph: the proof recorded in the served export's metadata.json}, read from the file itself."""
    (line,) = [line for line in _events(served.log(), "model_source") if f"model={model} " in line]
    graphs = json.loads((Path(re.search(r"export=(\S+)", line).group(1)) / "metadata.json").read_text())["graphs"]
    return {graph: {key: entry["validation"][key] for key in ("metric", "worst", "limit", "cases", "worst_case")}
            for graph, entry in graphs.items()}


def _proof_from_get_model_info(served):
    import grpc

    from serve.protocols.pb import pb, pb_grpc

    with grpc.insecure_channel(served.target) as channel:
        info = pb_grpc.EncoderServiceStub(channel).GetModelInfo(pb.GetModelInfoRequest(model="rr"), timeout=30)
    return {v.graph: {"metric": v.metric, "worst": v.worst, "limit": v.limit, "cases": v.cases,
                      "worst_case": v.worst_case} for v in info.validation}


def _proof_from_tei_info(served):
    return httpx.get(f"http://127.0.0.1:{served.http_port}/models/rr/info", timeout=30).json()["validation"]


def _proof_from_v2_metadata(served):
    return httpx.get(f"http://127.0.0.1:{served.http_port}/v2/models/rr", timeout=30).json()["validation"]


@pytest.mark.parametrize("surface", [_proof_from_get_model_info, _proof_from_tei_info, _proof_from_v2_metadata],
                         ids=["GetModelInfo", "tei-info", "v2-rest-metadata"])
def test_the_exports_parity_proof_is_where_users_look(served, surface):
    proof = surface(served)
    assert proof == _proof_in_metadata(served, "rr") and proof["fp32"]["cases"] > 0


def test_the_start_up_line_gives_each_models_parity_proof(served):
    for line in _events(served.log(), "model_source"):
        assert re.search(r'validation="fp32 max_abs \S+ <= 0\.0001, \d+ cases"', line), line


def test_a_second_start_reuses_the_export_cache_without_exporting(served, hub, export_cache):
    again = _prepare(hub, export_cache, EMBEDDER_ID, f"rr={RERANKER_ID}")
    assert again.returncode == 0, again.stderr
    assert _events(again.stderr, "export_started") == []
    sources = _events(again.stderr, "model_source")
    assert len(sources) == 2 and all("cache=hit" in line for line in sources)


def test_the_cache_warming_job_needs_neither_grpc_nor_the_servers_generated_code(served, hub, export_cache,
                                                                                 tmp_path):
    """The export image holds the exporter and model/, not gRPC: `--prepare-only` must run there. Stand-in for that
    image: grpc (which the server and its generated code import) is made unimportable."""
    blocked = tmp_path / "no-grpc"
    blocked.mkdir()
    (blocked / "grpc.py").write_text("raise ImportError('no grpc in the export image')\n")
    done = _prepare(hub, export_cache, EMBEDDER_ID,
                    env={"PYTHONPATH": f"{blocked}{os.pathsep}{repo_env()['PYTHONPATH']}"})
    assert done.returncode == 0, done.stderr
    assert len(_events(done.stderr, "models_prepared")) == 1
    # the control: the server itself does need it
    server = subprocess.run([sys.executable, "-m", "serve", "--export-dir", str(tmp_path / "none")], cwd=REPO,
                            env={**repo_env(), "PYTHONPATH": f"{blocked}{os.pathsep}{repo_env()['PYTHONPATH']}"},
                            capture_output=True, text=True, timeout=120)
    assert server.returncode != 0 and "no grpc in the export image" in server.stderr


def test_models_by_id_are_served_beside_the_repositorys_folders(served, hub, export_cache, serve_start,
                                                                serve_export_dir, tmp_path):
    repository = tmp_path / "repository"
    repository.mkdir()
    os.symlink(serve_export_dir, repository / "serve-test")
    both = serve_start(REPO, "--model", EMBEDDER_ID, "--model-repository", str(repository), "--export-cache",
                       str(export_cache), *FLAGS, "--default-model", "serve-test", env=_offline(hub), timeout=600)
    listed = httpx.get(f"http://127.0.0.1:{both.http_port}/v1/models", timeout=30).json()
    assert {m["id"] for m in listed["data"]} == {"all-minilm-l6-v2", "serve-test"}
    assert _events(both.log(), "export_started") == []  # the id's export came from the cache


def test_a_name_both_in_the_repository_and_by_id_is_refused(tmp_path):
    from serve.assembly import model_ids
    from serve.config import ServerConfig

    (tmp_path / "repo" / "m").mkdir(parents=True)
    (tmp_path / "repo" / "m" / "metadata.json").write_text("{}")
    config = ServerConfig(model="m=org/m", model_repository=str(tmp_path / "repo"))
    with pytest.raises(model_ids.ModelSourceError, match="model name m is both a folder of model_repository"):
        model_ids.repository_models(config, model_ids.specs_of(config))


def test_a_new_revision_is_exported_anew_into_its_own_entry(served, hub, export_cache):
    main_export = re.search(r"export=(\S+)", _events(_prepare(hub, export_cache, f"rr={RERANKER_ID}").stderr,
                                                      "model_source")[0]).group(1)
    v2 = _prepare(hub, export_cache, f"rr={RERANKER_ID}@v2")
    assert v2.returncode == 0, v2.stderr
    (source,) = _events(v2.stderr, "model_source")
    assert "cache=exported" in source and f"commit={hub['snapshots'][RERANKER_ID + '@v2'].name}" in source
    assert re.search(r"export=(\S+)", source).group(1) != main_export


def test_two_servers_starting_at_once_export_once(hub, tmp_path):
    cache = tmp_path / "export-cache"
    both = [_prepare(hub, cache, f"rr={RERANKER_ID}", stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            for _ in range(2)]
    logs = [process.communicate(timeout=600)[1] for process in both]
    assert [process.returncode for process in both] == [0, 0], logs
    assert sum(len(_events(log, "export_started")) for log in logs) == 1
    exports = {re.search(r"export=(\S+)", _events(log, "model_source")[0]).group(1) for log in logs}
    assert len(exports) == 1
    assert [p.name for p in cache.iterdir() if p.name.startswith(".")] == []  # no scratch folder left


def test_an_unknown_id_offline_fails_in_one_line_naming_it_and_the_cache(hub, tmp_path):
    failed = _prepare(hub, tmp_path / "export-cache", "nobody/no-such-model")
    assert failed.returncode == 1
    (line,) = [line for line in failed.stderr.splitlines() if line.strip()]
    assert "event=startup_failed" in line and "nobody/no-such-model" in line and str(hub["cache"]) in line
    assert "Traceback" not in failed.stderr


def test_the_exporter_takes_a_model_id_and_a_revision(hub, tmp_path):
    done = subprocess.run([sys.executable, "-m", "export", "--from-pretrained", f"{RERANKER_ID}@v2", "--out-dir",
                           str(tmp_path), "--name", "rr", "--graphs", "fp32", "--quiet"],
                          cwd=REPO, env={**repo_env(), **_offline(hub)}, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    source = json.loads((tmp_path / "rr" / "metadata.json").read_text())["config"]["source"]
    assert str(hub["snapshots"][RERANKER_ID + "@v2"]) in json.dumps(source)


def test_a_qwen3_reranker_by_id_with_its_export_option_ranks_as_the_model_cards_recipe(hub, serve_start, tmp_path):
    """The option a checkpoint needs to be served as what it is (here `--reranker-template qwen3`: Qwen3-Reranker is a
    Qwen3ForCausalLM, which exports as an embedder without it) travels with its id in the models file."""
    from tests.hf_references import RERANKER_DOCUMENTS, RERANKER_QUERY, CardRecipe, save_qwen3_reranker

    checkpoint = tmp_path / "qwen3-reranker"
    save_qwen3_reranker(checkpoint)
    commit = add_revision(hub["cache"], "test-org/tiny-qwen3-reranker", checkpoint)
    models = tmp_path / "models.txt"
    models.write_text("# an LLM reranker needs its template\nrr=test-org/tiny-qwen3-reranker --reranker-template qwen3\n")
    server = serve_start(REPO, "--models-file", str(models), "--export-cache", str(tmp_path / "export-cache"), *FLAGS,
                         env=_offline(hub), timeout=600)
    answer = httpx.post(f"http://127.0.0.1:{server.http_port}/v1/rerank", timeout=60,
                        json={"model": "rr", "query": RERANKER_QUERY, "documents": RERANKER_DOCUMENTS})
    assert answer.status_code == 200, answer.text
    scores = {r["index"]: r["relevance_score"] for r in answer.json()["results"]}
    snapshot = hub["cache"] / "models--test-org--tiny-qwen3-reranker" / "snapshots" / commit
    expected = CardRecipe(snapshot).scores(RERANKER_QUERY, RERANKER_DOCUMENTS)
    np.testing.assert_allclose([scores[i] for i in range(len(RERANKER_DOCUMENTS))], expected, atol=SCORE_ATOL, rtol=0)


# -- without a server: the rules, each in its one place --------------------------------------------------------

def test_a_spec_names_the_model_its_id_and_revision():
    from model.hub import ModelSpec, parse_spec

    assert parse_spec("BAAI/bge-base-en-v1.5") == ModelSpec("bge-base-en-v1.5", "BAAI/bge-base-en-v1.5", None)
    assert parse_spec("bge=BAAI/bge-base-en-v1.5@v1.5") == ModelSpec("bge", "BAAI/bge-base-en-v1.5", "v1.5")


def test_a_spec_may_carry_the_models_own_export_options():
    from model.hub import ModelSpec, parse_spec

    assert parse_spec("rr=Qwen/Qwen3-Reranker-0.6B@main --reranker-template qwen3 --graphs 'fp32,optimized'") == \
        ModelSpec("rr", "Qwen/Qwen3-Reranker-0.6B", "main", ("--reranker-template", "qwen3", "--graphs", "fp32,optimized"))


@pytest.mark.parametrize("option", ["--out-dir /tmp/x", "--name=other", "--from-pretrained org/other"])
def test_an_export_option_the_server_sets_itself_is_refused_naming_it(option):
    from model.hub import HubError, parse_spec

    with pytest.raises(HubError, match=f"{option.split()[0].split('=')[0]} is set by the server"):
        parse_spec(f"org/name {option}")


@pytest.mark.parametrize("text", ["=org/name", "org/name@", "name="])
def test_a_spec_with_an_empty_part_is_refused_naming_the_form(text):
    from model.hub import HubError, parse_spec

    with pytest.raises(HubError, match=r"expected \[NAME=\]ORG/NAME\[@REVISION\]"):
        parse_spec(text)


def test_two_models_under_one_name_are_refused():
    from serve.assembly.model_ids import ModelSourceError, specs_of
    from serve.config import ServerConfig

    with pytest.raises(ModelSourceError, match="model name m given twice"):
        specs_of(ServerConfig(model="m=org/a,m=org/b"))


def test_models_file_lists_one_per_line_with_comments(tmp_path):
    from model.hub import ModelSpec
    from serve.assembly.model_ids import specs_of
    from serve.config import ServerConfig

    listing = tmp_path / "models.txt"
    listing.write_text("# embedders\nBAAI/bge-small-en-v1.5\n\nrr=org/reranker@v2  # the reranker\n")
    assert specs_of(ServerConfig(models_file=str(listing))) == [
        ModelSpec("bge-small-en-v1.5", "BAAI/bge-small-en-v1.5", None), ModelSpec("rr", "org/reranker", "v2")]


def test_the_model_flag_repeats(tmp_path):
    from serve.config import load_config

    config = load_config(["--model", "org/a", "--model", "b=org/b@v2"], environ={})
    assert config.model == "org/a,b=org/b@v2"


def test_an_interrupted_export_leaves_no_entry_and_the_next_start_exports(tmp_path):
    from model.export_cache import ExportCache, checkpoint_files

    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text("{}")
    cache, files = ExportCache(tmp_path / "cache"), checkpoint_files(checkpoint)

    def broken(out_dir, name):
        (out_dir / name).mkdir()
        (out_dir / name / "model.onnx").write_bytes(b"half")
        raise KeyboardInterrupt  # the exporter stopped half-way

    with pytest.raises(KeyboardInterrupt):
        cache.get(files, ["--graphs", "fp32"], {}, broken)
    assert list(cache.root.glob("*/model")) == [] and list(cache.root.glob(".*")) == []

    def whole(out_dir, name):
        (out_dir / name).mkdir()
        (out_dir / name / "metadata.json").write_text("{}")

    export, exported = cache.get(files, ["--graphs", "fp32"], {}, whole)
    assert exported and (export / "metadata.json").is_file()


def test_a_changed_file_or_option_is_another_entry(tmp_path):
    from model.export_cache import checkpoint_files, key

    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    (checkpoint / "model.safetensors").write_bytes(b"weights")
    first = key(checkpoint_files(checkpoint), ["--graphs", "fp32"])
    assert key(checkpoint_files(checkpoint), ["--graphs", "fp32,fp16"]) != first
    (checkpoint / "model.safetensors").write_bytes(b"other weights")
    assert key(checkpoint_files(checkpoint), ["--graphs", "fp32"]) != first


def test_a_server_without_the_exporter_names_the_job_that_fills_the_cache(tmp_path, monkeypatch):
    """Stand-in: this venv has torch, so find_spec is made to answer as an image without it would."""
    import importlib.util

    from model.export_cache import ExportCache
    from model.hub import ModelSpec, Resolved
    from serve.assembly import model_ids

    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text("{}")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torch" else real(name, *a))
    with pytest.raises(model_ids.ModelSourceError, match=r"cannot export \(no torch.*--prepare-only true --model org/m"):
        model_ids.export_of(ModelSpec("m", "org/m", None), Resolved("org/m", None, "c" * 40, checkpoint),
                            ExportCache(tmp_path / "cache"), ["--graphs", "fp32"])


@pytest.mark.parametrize("error, says", [
    ("GatedRepoError", "gated on the Hugging Face Hub; accept its terms on its page and set HF_TOKEN"),
    ("RepositoryNotFoundError", "no such model on the Hugging Face Hub"),
    ("RevisionNotFoundError", "no revision 'v9'"),
])
def test_the_hubs_refusals_are_one_line_naming_the_id_and_what_to_do(error, says, monkeypatch):
    """Stand-in for the Hub (not reachable here): snapshot_download raises the hub library's own exception."""
    import httpx2  # the HTTP library huggingface_hub answers with
    import huggingface_hub
    from huggingface_hub import errors

    from model.hub import HubError, resolve

    def refuse(*args, **kwargs):
        request = httpx2.Request("GET", "https://huggingface.co/api/models/org/model/revision/v9")
        raise getattr(errors, error)("refused", response=httpx2.Response(404, request=request))

    monkeypatch.setattr(huggingface_hub, "snapshot_download", refuse)
    with pytest.raises(HubError) as refused:
        resolve("org/model", "v9")
    assert says in str(refused.value) and "org/model@v9" in str(refused.value) and "\n" not in str(refused.value)
