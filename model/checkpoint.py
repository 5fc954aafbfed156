"""Our own checkpoints: weights saved from `Encoder.state_dict()`, and the strict loading every
checkpoint goes through (Hugging Face directories too: model/hf_pretrained.py).

  save_state_dict_file(encoder, path)  a .safetensors (config in its metadata) or .pt file
  load_state_dict_file(path, config)   the eval-mode encoder back from such a file

`fit_encoder` checks the weights strictly: every tensor the encoder needs is present, every tensor
in the file is used (or on a caller's explicit ignore list), every shape matches. Anything else is a
`CheckpointError` whose message lists what is missing, left over and mis-shaped. No unpickling:
safetensors are read with `safetensors`, and a torch file only with `torch.load(..., weights_only=True)`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence

import torch

from model.config import ConfigError, EncoderConfig, from_json, to_json
from model.encoder import Encoder, build_encoder

CONFIG_METADATA_KEY = "encoder_config"  # where save_state_dict_file puts the config in .safetensors


class CheckpointError(ValueError):
    """A checkpoint that does not fit the encoder; the message lists every problem found."""

    def __init__(
        self,
        message: str,
        *,
        missing: Sequence[str] = (),
        unexpected: Sequence[str] = (),
        mis_shaped: Sequence[str] = (),
    ) -> None:
        super().__init__(message)
        self.missing = tuple(missing)
        self.unexpected = tuple(unexpected)
        self.mis_shaped = tuple(mis_shaped)


# --------------------------------------------------------------------------------------------
# Strict loading of a name -> tensor mapping into an encoder.


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(n) for n in t.shape)


def fit_encoder(
    config: EncoderConfig,
    tensors: Mapping[str, torch.Tensor],
    *,
    origin: str,
    checkpoint_names: Mapping[str, str] | None = None,
    unused: Iterable[str] = (),
    name_in_checkpoint: Callable[[str], str | None] | None = None,
) -> Encoder:
    """An eval-mode encoder with `tensors` (already in our names) loaded, or a CheckpointError.

    `checkpoint_names` maps our names back to the file's names for messages (and
    `name_in_checkpoint` names the tensors the file lacks); `unused` are file names that map to
    nothing and were not on the ignore list.
    """
    checkpoint_names = checkpoint_names or {}

    def shown(ours: str) -> str:
        theirs = checkpoint_names.get(ours) or (name_in_checkpoint(ours) if name_in_checkpoint else None)
        return f"{theirs} (-> {ours})" if theirs and theirs != ours else ours

    encoder = build_encoder(config)  # its state dict names the tensors and shapes we need
    expected = {k: _shape(v) for k, v in encoder.state_dict().items()}
    missing = [shown(k) for k in expected if k not in tensors]
    unexpected = sorted(unused) + [shown(k) for k in tensors if k not in expected]
    mis_shaped = [
        f"{shown(k)}: checkpoint {_shape(v)} vs encoder {expected[k]}"
        for k, v in tensors.items()
        if k in expected and _shape(v) != expected[k]
    ]
    mis_shaped += [
        f"{shown(k)}: dtype {v.dtype} is not floating point"
        for k, v in tensors.items()
        if k in expected and not v.is_floating_point()
    ]
    if missing or unexpected or mis_shaped:
        parts = []
        for label, items in (("missing", missing), ("unexpected", unexpected), ("mis-shaped", mis_shaped)):
            if items:
                parts.append(f"{label} ({len(items)}): " + ", ".join(items))
        raise CheckpointError(
            f"checkpoint {origin} does not fit encoder {config.name!r}: " + "; ".join(parts),
            missing=missing,
            unexpected=unexpected,
            mis_shaped=mis_shaped,
        )
    # Half-precision checkpoints are widened: the reference encoder computes in float32.
    state = {k: v.to(torch.float32).contiguous() for k, v in tensors.items()}
    encoder.load_state_dict(state, strict=True)
    return encoder.eval()


def read_tensor_file(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, safetensors metadata) from a .safetensors file or a weights-only torch pickle."""
    if not path.is_file():
        raise CheckpointError(f"checkpoint file {path} does not exist")
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        try:
            with safe_open(str(path), framework="pt") as handle:
                metadata = dict(handle.metadata() or {})
                return {k: handle.get_tensor(k) for k in handle.keys()}, metadata
        except (OSError, ValueError, RuntimeError) as exc:
            raise CheckpointError(f"cannot read safetensors file {path}: {exc}") from exc
    if path.suffix in (".pt", ".pth", ".bin"):
        try:
            loaded = torch.load(str(path), map_location="cpu", weights_only=True)
        except Exception as exc:  # weights_only refuses anything but tensors and plain containers
            raise CheckpointError(f"cannot read {path} as a weights-only torch file: {exc}") from exc
        if isinstance(loaded, Mapping) and "state_dict" in loaded and isinstance(loaded["state_dict"], Mapping):
            loaded = loaded["state_dict"]
        if not isinstance(loaded, Mapping) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in loaded.items()
        ):
            raise CheckpointError(f"{path} does not hold a mapping of tensor names to tensors")
        return dict(loaded), {}
    raise CheckpointError(f"unknown checkpoint format {path.suffix!r} for {path}: expected .safetensors, .pt, .pth or .bin")


# --------------------------------------------------------------------------------------------
# Our own checkpoints.


def save_state_dict_file(encoder: Encoder, path: str | Path) -> Path:
    """Writes `encoder.state_dict()`; a .safetensors file also carries the config as metadata."""
    path = Path(path)
    state = {k: v.detach().contiguous() for k, v in encoder.state_dict().items()}
    if path.suffix == ".safetensors":
        from safetensors.torch import save_file

        save_file(state, str(path), metadata={"format": "pt", CONFIG_METADATA_KEY: to_json(encoder.config)})
    else:
        torch.save(state, str(path))
    return path


def load_state_dict_file(path: str | Path, config: EncoderConfig | None = None) -> Encoder:
    """An eval-mode encoder from a file saved from `Encoder.state_dict()` (strict, see module doc).

    With `config=None` the config is read from the .safetensors metadata written by
    `save_state_dict_file`; a .pt file needs `config`.
    """
    path = Path(path)
    tensors, metadata = read_tensor_file(path)
    if config is None:
        text = metadata.get(CONFIG_METADATA_KEY)
        if text is None:
            raise CheckpointError(f"{path} records no encoder config; pass one (e.g. --variant)")
        try:
            config = from_json(text)
        except (ConfigError, ValueError) as exc:
            raise CheckpointError(f"{path} records an invalid encoder config: {exc}") from exc
    return fit_encoder(config, tensors, origin=str(path))
