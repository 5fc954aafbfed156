"""What the parity tests of the relative-position encoders share (MPNet's bias buckets, DeBERTa's disentangled
attention: dense graphs only): a transformers reference at a telling scale, its export with the exact and the
converted graphs, padded batches, and the hidden states of transformers, our encoder and a graph, compared at
real positions."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import torch

from export.cli import main as export_main
from model.hf_pretrained import load_pretrained
from model.masks import default_mask_inputs
from tests.hf_references import redraw

EXACT_GRAPHS = ("model.onnx", "model.optimized.onnx")  # within ATOL of transformers
CONVERTED_GRAPHS = {"model.int8.onnx": 0.998, "model.fp16.onnx": 0.9999}  # min cosine per real token


def reference_model(config_class: str, model_class: str, shape: dict, seed: int = 0, **changes):
    """transformers' `model_class` of `config_class`(shape, changes), eager, weights redrawn from `seed`."""
    import transformers

    config = getattr(transformers, config_class)(**{**shape, **changes})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    return redraw(getattr(transformers, model_class)(config), seed=seed)


def exported(reference, tmp_path_factory, name: str):
    """(reference, our loaded model, {graph file: CPU session}, export directory) of `reference` saved and exported
    with every graph (fp32, optimized, int8, fp16; a long graph asked for, which these families do not write)."""
    checkpoint = tmp_path_factory.mktemp(name)
    reference.save_pretrained(str(checkpoint))
    out = tmp_path_factory.mktemp(f"{name}-export")
    assert export_main(["--from-pretrained", str(checkpoint), "--out-dir", str(out), "--name", name,
                        "--graphs", "fp32,optimized,int8,fp16,long", "--quiet"]) == 0
    sessions = {file: ort.InferenceSession(str(out / name / file), providers=["CPUExecutionProvider"])
                for file in (*EXACT_GRAPHS, *CONVERTED_GRAPHS)}
    return reference, load_pretrained(checkpoint), sessions, out / name


def batch(lengths: list[int], vocab_size: int, pad_id: int, seed: int = 0,
          left: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask): rows of random non-special ids, `pad_id` in the padding (right or left)."""
    generator = torch.Generator().manual_seed(seed)
    length = max(lengths)
    ids = torch.randint(5, vocab_size, (len(lengths), length), generator=generator)
    mask = torch.zeros(len(lengths), length, dtype=torch.int64)
    for row, n in enumerate(lengths):
        if left:
            mask[row, length - n:] = 1
        else:
            mask[row, :n] = 1
    return torch.where(mask.bool(), ids, torch.full_like(ids, pad_id)), mask


def transformers_hidden(reference, ids, mask, token_type_ids=None) -> np.ndarray:
    with torch.no_grad():
        extra = {} if token_type_ids is None else {"token_type_ids": token_type_ids}
        return reference(input_ids=ids, attention_mask=mask, **extra).last_hidden_state.numpy()


def ours_hidden(encoder, ids, mask, token_type_ids=None) -> np.ndarray:
    with torch.no_grad():
        return encoder(ids, mask, **default_mask_inputs(mask), token_type_ids=token_type_ids)[0].numpy()


def graph_hidden(session, ids, mask) -> np.ndarray:
    feeds = {"input_ids": ids.numpy(), "attention_mask": mask.numpy(),
             **{k: v.numpy() for k, v in default_mask_inputs(mask).items()}}
    return session.run(["last_hidden_state"], feeds)[0]


def max_error(actual, expected, mask) -> float:
    valid = mask.numpy().astype(bool)
    return float(np.abs(actual[valid] - expected[valid]).max())


def min_token_cosine(actual, expected, mask) -> float:
    valid = mask.numpy().astype(bool)
    a, b = actual[valid], expected[valid]
    return float(((a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))).min())


def assert_every_graph_matches(exported_model, ids, mask, atol: float) -> None:
    """Our encoder and the exact graphs within `atol` of transformers at real positions; the converted graphs at
    least their cosine per real token."""
    reference, loaded, sessions, _ = exported_model
    expected = transformers_hidden(reference, ids, mask)
    assert max_error(ours_hidden(loaded.encoder, ids, mask), expected, mask) <= atol
    for name in EXACT_GRAPHS:
        error = max_error(graph_hidden(sessions[name], ids, mask), expected, mask)
        assert error <= atol, f"{name}: {error}"
    for name, limit in CONVERTED_GRAPHS.items():
        cosine = min_token_cosine(graph_hidden(sessions[name], ids, mask), expected, mask)
        assert cosine >= limit, f"{name}: {cosine}"


def optimized_ops(directory) -> set[str]:
    """The operator types of an export's optimized graph (whether ONNX Runtime's optimizer fused attention)."""
    import onnx

    return {node.op_type for node in onnx.load(str(directory / "model.optimized.onnx")).graph.node}
