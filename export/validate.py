"""Validation of a written graph against the PyTorch reference: names, then shapes, then values.

Unlike Optimum, which warns, a failed validation raises a typed error and fails the export.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
import onnxruntime as ort
import torch

from export.cases import Case
from export.contract import MAX_IR_VERSION, ExportContract
from model.signature import input_names


class ExportValidationError(Exception):
    """The written graph does not match the contract or the reference."""


class InputNamesMismatch(ExportValidationError):
    pass


class ShapeMismatch(ExportValidationError):
    pass


class NonFiniteOutput(ExportValidationError):
    pass


class ToleranceExceeded(ExportValidationError):
    pass


@dataclass
class ValidationReport:
    metric: str
    limit: float
    worst: float = 0.0
    worst_case: str = ""
    cases: int = 0
    per_case: list = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return self.worst <= self.limit if self.metric == "max_abs" else self.worst >= self.limit

    def as_dict(self) -> dict:
        return {"cases": self.cases, "metric": self.metric, "limit": self.limit,
                "worst": self.worst, "worst_case": self.worst_case, "passed": self.passed}


def _graph_dims(value_info) -> tuple:
    return tuple(d.dim_param or d.dim_value for d in value_info.type.tensor_type.shape.dim)


def check_graph_contract(path: str, contract: ExportContract) -> onnx.ModelProto:
    """Full onnx.checker, IR version, input/output names and their symbolic dims in the saved file."""
    proto = onnx.load(path, load_external_data=False)  # the graph; the checker reads the weights by path
    if proto.ir_version > MAX_IR_VERSION:
        raise ExportValidationError(f"IR version {proto.ir_version} > {MAX_IR_VERSION} (onnxruntime limit)")
    # by path, never the proto's bytes: a graph with external data (over 2 GB) cannot be serialised whole
    onnx.checker.check_model(path, full_check=True)
    for kind, specs, values in (("input", contract.inputs, proto.graph.input),
                                ("output", contract.outputs, proto.graph.output)):
        names = [v.name for v in values]
        expected = [s.name for s in specs]
        if names != expected:
            raise InputNamesMismatch(f"graph {kind}s {names} != contract {expected}")
        for spec, value in zip(specs, values):
            dims = _graph_dims(value)
            if len(dims) != len(spec.dims) or any(
                (isinstance(want, str) and not isinstance(got, str)) or (isinstance(want, int) and got != want)
                for want, got in zip(spec.dims, dims)
            ):
                raise ShapeMismatch(f"{kind} {spec.name}: graph dims {list(dims)}, contract {list(spec.dims)}")
    return proto


def reference_outputs(model: torch.nn.Module, contract: ExportContract, feeds: dict) -> list[np.ndarray]:
    """The dense PyTorch encoder's outputs: every graph, on any path, is judged against it."""
    args = [torch.from_numpy(np.ascontiguousarray(feeds[name])) for name in input_names(contract.config)]
    with torch.no_grad():
        return [t.numpy() for t in model(*args)]


def _cosine_min(a: np.ndarray, b: np.ndarray) -> float:
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    na, nb = np.linalg.norm(a64, axis=-1), np.linalg.norm(b64, axis=-1)
    live = (na > 0) & (nb > 0)
    if not live.any():
        return 1.0
    cos = (a64[live] * b64[live]).sum(-1) / (na[live] * nb[live])
    return float(cos.min())


def _logits_agreement_min(a: np.ndarray, b: np.ndarray) -> float:
    """Per row, 1 - |a - b|² / (2·max(|b|², 1)): the relative error e of a row of logits put on the cosine
    scale (1 - e²/2 is the cosine of two vectors of equal norm, e apart), a norm below 1 counted as 1.
    The cosine itself says nothing of one logit (it is its sign), nor of logits near 0."""
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    error = ((a64 - b64) ** 2).sum(-1)
    scale = np.maximum((b64 ** 2).sum(-1), 1.0)
    return float((1.0 - error / (2.0 * scale)).min(initial=1.0))


def output_scores(actual: list[np.ndarray], expected: list[np.ndarray], feeds: dict, metric: str,
                  head: str = "none") -> list[float]:
    """One score per output, in graph order. max_abs: the max abs error (hidden states at valid positions,
    every entry of the pooled vector and of the head's output). min_cosine: the hidden states are judged
    through the pooled vectors (their score is repeated), the head's output by its rows: `head` "sparse"
    (sparse_embedding) by their cosine, "classification" (logits) by their relative error on the cosine
    scale (_logits_agreement_min)."""
    if metric == "max_abs":
        hidden = np.abs(actual[0] - expected[0])[feeds["attention_mask"].astype(bool)].max(initial=0.0)
        return [float(hidden), *(float(np.abs(got - want).max(initial=0.0))
                                 for got, want in zip(actual[1:], expected[1:]))]
    if metric == "min_cosine":
        pooled = _cosine_min(actual[1], expected[1])
        agreement = _cosine_min if head in ("sparse", "multivector") else _logits_agreement_min
        return [pooled, pooled, *(agreement(got, want) for got, want in zip(actual[2:], expected[2:]))]
    raise ValueError(f"unknown tolerance metric {metric!r}")


def compare(actual: list[np.ndarray], expected: list[np.ndarray], feeds: dict, metric: str,
            head: str = "none") -> float:
    """The case's score: the worst of `output_scores`."""
    scores = output_scores(actual, expected, feeds, metric, head)
    return max(scores) if metric == "max_abs" else min(scores)


def validate(
    path: str,
    model: torch.nn.Module,
    contract: ExportContract,
    cases: list[Case],
    *,
    tolerance: dict | None = None,
    providers: tuple[str, ...] = ("CPUExecutionProvider",),
) -> ValidationReport:
    tolerance = tolerance or contract.tolerance
    metric, limit = tolerance["metric"], float(tolerance["limit"])
    check_graph_contract(path, contract)
    session = ort.InferenceSession(path, providers=list(providers))
    report = ValidationReport(metric=metric, limit=limit, worst=0.0 if metric == "max_abs" else 1.0)
    out_names = [s.name for s in contract.outputs]
    for case in cases:
        actual = session.run(out_names, {s.name: case.feeds[s.name] for s in contract.inputs})
        expected = reference_outputs(model, contract, case.feeds)
        for spec, got, want in zip(contract.outputs, actual, expected):
            if got.shape != want.shape or got.dtype != np.float32:
                raise ShapeMismatch(f"{case.label}: {spec.name} {got.shape} {got.dtype}, expected {want.shape} float32")
            if not np.isfinite(got).all():
                raise NonFiniteOutput(f"{case.label}: {spec.name} has NaN or Inf")
        scores = output_scores(actual, expected, case.feeds, metric, head=contract.config.head)
        score = max(scores) if metric == "max_abs" else min(scores)
        report.cases += 1
        report.per_case.append((case.label, score))
        worse = score > report.worst if metric == "max_abs" else score < report.worst
        if worse:
            report.worst, report.worst_case = score, f"{case.label}, {out_names[scores.index(score)]}"
    failed = report.worst > limit if metric == "max_abs" else report.worst < limit
    if failed:
        raise ToleranceExceeded(
            f"{metric} {report.worst:.3g} beyond limit {limit:g} (worst case: {report.worst_case})"
        )
    return report
