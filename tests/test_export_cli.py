"""`python -m export`: what it writes, what it prints, and how it refuses bad input."""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import onnx
import onnxruntime as ort
import pytest

from export.cli import EXIT_BAD_INPUT, EXIT_VALIDATION_FAILED, build_parser, main
from export.contract import FP32_TOLERANCE
from export.graphs import GRAPHS, GraphVariant
from model.config import EncoderConfig

REPO = Path(__file__).resolve().parent.parent
SMALL = ["--set", "d_model=32", "--set", "n_heads=4", "--set", "n_layers=1", "--set", "d_ff=64",
         "--set", "vocab_size=50", "--set", "max_positions=128"]


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli")
    proc = subprocess.run([sys.executable, "-m", "export", "--out-dir", str(out), *SMALL],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    return out, proc


def test_no_arguments_means_the_default_config_into_exports_default():
    args = build_parser().parse_args([])
    assert args.out_dir == Path("exports") and args.variant == [] and not args.all_variants
    assert EncoderConfig().name == "default"


def test_from_pretrained_help_names_every_registered_model_type():
    from model.hf_pretrained import SUPPORTED_MODEL_TYPES

    action = next(a for a in build_parser()._actions if "--from-pretrained" in a.option_strings)
    assert f"model_type {', '.join(SUPPORTED_MODEL_TYPES)};" in action.help


def test_export_command_succeeds_and_prints_a_summary_table(written):
    out, proc = written
    assert proc.returncode == 0, proc.stderr
    assert "model.onnx" in proc.stdout and "opset" in proc.stdout
    assert "input_ids[batch,sequence]" in proc.stdout and "last_hidden_state[batch,sequence,32]" in proc.stdout
    assert "ok (max_abs" in proc.stdout
    assert "validating fp32" in proc.stderr  # progress goes to the console


def test_written_model_loads_in_onnxruntime_and_passes_the_full_checker(written):
    path = written[0] / "default" / "model.onnx"
    onnx.checker.check_model(onnx.load(str(path)), full_check=True)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert [i.shape for i in session.get_inputs()][0] == ["batch", "sequence"]


def test_metadata_records_config_contract_versions_and_hash(written):
    directory = written[0] / "default"
    meta = json.loads((directory / "metadata.json").read_text())
    assert meta["config"]["d_model"] == 32 and meta["config"]["n_layers"] == 1
    assert meta["opset"] == 18
    assert meta["inputs"][0] == {"name": "input_ids", "dtype": "int64", "dims": ["batch", "sequence"]}
    assert [o["name"] for o in meta["outputs"]] == ["last_hidden_state", "mean_pooled"]
    assert meta["mask_kinds"]["local_strided"] == 4
    graph = meta["graphs"]["fp32"]
    assert graph["sha256"] == hashlib.sha256((directory / "model.onnx").read_bytes()).hexdigest()
    assert graph["tolerance"] == {"metric": "max_abs", "limit": 1e-4}
    validation = graph["validation"]
    # the figures the verdict rests on, not only the verdict: every case ran, the worst is within the limit
    assert validation["cases"] >= 30
    assert validation["limit"] == 1e-4 and 0 <= validation["worst"] <= validation["limit"]
    assert validation["passed"] is True
    assert {"torch", "onnx", "onnxruntime"} <= set(meta["versions"])


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def test_every_exported_file_gets_the_mode_a_plain_open_gives(written):
    """Not mkstemp's 0600: a server running as another user (the image's uid 10001, on a bind-mounted
    host export) must read metadata.json and the graphs. The export ran with this process's umask."""
    directory = written[0] / "default"
    expected = 0o666 & ~_umask()
    modes = {path.name: stat.S_IMODE(path.stat().st_mode) for path in directory.iterdir()}
    assert "metadata.json" in modes and modes == dict.fromkeys(modes, expected), (oct(expected), modes)
    assert stat.S_IMODE(directory.stat().st_mode) == 0o755


@pytest.mark.parametrize("umask,mode", [(0o022, 0o644), (0o027, 0o640)])
def test_metadata_is_written_readable_by_others_unless_the_umask_says_otherwise(written, tmp_path, umask, mode):
    from model.export_format import read_metadata, write_metadata

    metadata = read_metadata(written[0] / "default")
    previous = os.umask(umask)
    try:
        path = write_metadata(tmp_path, metadata)
    finally:
        os.umask(previous)
    assert stat.S_IMODE(path.stat().st_mode) == mode
    assert [p.name for p in tmp_path.iterdir()] == ["metadata.json"]  # no temporary file left beside it


def test_nothing_but_the_export_is_left_in_the_output_directory(written):
    assert sorted(p.name for p in written[0].iterdir()) == ["default"]


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_unknown_variant_is_refused_with_the_known_ones(tmp_path, capsys):
    assert main(["--out-dir", str(tmp_path), "--variant", "sparse-moe"]) == EXIT_BAD_INPUT
    line = _one_error_line(capsys)
    assert "unknown variant sparse-moe" in line and "pre-norm" in line


def test_heads_not_dividing_d_model_is_refused(tmp_path, capsys):
    assert main(["--out-dir", str(tmp_path), "--set", "n_heads=3"]) == EXIT_BAD_INPUT
    assert "n_heads=3 does not divide d_model=256" in _one_error_line(capsys)


def test_unreadable_checkpoint_is_refused(tmp_path, capsys):
    missing = tmp_path / "nope.safetensors"
    assert main(["--out-dir", str(tmp_path / "out"), "--checkpoint", str(missing), *SMALL]) == EXIT_BAD_INPUT
    assert "nope.safetensors" in _one_error_line(capsys)


def test_checkpoint_of_another_shape_is_refused_naming_the_tensors(tmp_path, capsys):
    from model.checkpoint import save_state_dict_file
    from model.encoder import build_encoder

    other = EncoderConfig(d_model=16, n_heads=4, n_layers=1, d_ff=64, vocab_size=50, max_positions=128)
    path = save_state_dict_file(build_encoder(other), tmp_path / "other.pt")
    assert main(["--out-dir", str(tmp_path / "out"), "--checkpoint", str(path), *SMALL]) == EXIT_BAD_INPUT
    line = _one_error_line(capsys)
    assert "mis-shaped" in line and "q_proj" in line


def test_unwritable_output_directory_is_refused(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    assert main(["--out-dir", str(blocker / "exports"), *SMALL]) == EXIT_BAD_INPUT
    assert "not writable" in _one_error_line(capsys)


def _perturbed(src: str, dst: str, config) -> None:
    """A graph that is valid ONNX but computes something else: one weight scaled by 1.01."""
    model = onnx.load(src)
    for init in model.graph.initializer:
        if init.dims and len(init.dims) == 2:
            array = onnx.numpy_helper.to_array(init) * 1.01
            init.CopyFrom(onnx.numpy_helper.from_array(array.astype(array.dtype), init.name))
            break
    onnx.save(model, dst)


def test_a_graph_that_fails_parity_fails_the_export_and_leaves_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(GRAPHS, "perturbed", GraphVariant("perturbed", "model.perturbed.onnx",
                                                          dict(FP32_TOLERANCE), _perturbed))
    out = tmp_path / "out"
    code = main(["--out-dir", str(out), "--graphs", "fp32,perturbed", "--quiet", *SMALL])
    assert code == EXIT_VALIDATION_FAILED
    line = _one_error_line(capsys)
    assert "validation failed" in line and "beyond limit 0.0001" in line
    assert list(out.iterdir()) == []


def test_failed_export_keeps_the_previous_export_intact(tmp_path, capsys, monkeypatch, written):
    out = tmp_path / "out"
    out.mkdir()
    previous = written[0] / "default"
    (out / "default").mkdir()
    for f in previous.iterdir():
        (out / "default" / f.name).write_bytes(f.read_bytes())
    monkeypatch.setitem(GRAPHS, "perturbed", GraphVariant("perturbed", "model.perturbed.onnx",
                                                          dict(FP32_TOLERANCE), _perturbed))
    assert main(["--out-dir", str(out), "--graphs", "perturbed", "--quiet", *SMALL]) == EXIT_VALIDATION_FAILED
    assert sorted(p.name for p in out.iterdir()) == ["default"]
    assert (out / "default" / "metadata.json").read_bytes() == (previous / "metadata.json").read_bytes()


def test_an_export_the_host_cannot_hold_is_refused_before_any_graph_naming_the_need(tmp_path, capsys, monkeypatch):
    import export.exporter

    monkeypatch.setattr(export.exporter, "available_memory", lambda: 1024)  # a host with 1 KiB free
    assert main(["--out-dir", str(tmp_path / "out"), *SMALL]) == EXIT_BAD_INPUT
    line = _one_error_line(capsys)
    assert "needs about" in line and "GiB of float32 weights" in line and "0.0 GiB available" in line
    assert not any((tmp_path / "out").iterdir())  # nothing written, no staging left


def test_the_summary_states_the_exports_peak_memory(written):
    _, proc = written
    assert re.search(r"wrote 1 export\(s\) in [\d.]+ s, peak memory [\d.]+ GiB", proc.stdout)
