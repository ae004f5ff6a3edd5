"""``fp4ptq quantize``: load_source_model -> QuantConfig -> quantize -> save, every cheap check first."""
from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path
from typing import Optional

from .common import (
    EXIT_OK,
    EXIT_UNSUPPORTED,
    EXIT_USAGE,
    OUT_ROOT,
    CLIError,
    _device,
    _dtype,
    _is_checkpoint,
    _model_name,
    _options,
    _prepare_output,
    _quiet_libraries,
    _recipe_text,
    _say,
)


def _recipe_slug(config) -> str:
    four_six = f"-46{config.four_six}" if config.four_six else ""
    return f"{config.method.replace('+', '-')}{_options(config.to_dict(), '-')}{four_six}-{config.scheme}"


def cmd_quantize(args) -> int:
    import fp4ptq

    from ..config import ConfigError

    started = time.perf_counter()
    fields = dict(method=args.method, four_six=args.four_six, scheme=args.scheme, seed=args.seed)
    for name in ("calib", "nsamples", "seqlen", "search_nsamples", "awq_grid", "moe_calib"):
        if getattr(args, name) is not None:
            fields[name] = getattr(args, name)
    if args.ignore:
        fields["ignore"] = tuple(args.ignore)
    if args.awq_clip:
        fields["awq_clip"] = True
    if args.act_order:
        fields["gptq_act_order"] = True
    # issue 43: rotations, scale searches, keep budget
    for name in ("rotate", "keep_budget", "keep_unit", "keep_nsamples"):
        if getattr(args, name) is not None:
            fields[name] = getattr(args, name)
    if args.rotate_fixed:
        fields["rotate_random"] = False
    if args.rotate_no_residual:
        fields["rotate_residual"] = False
    if args.rotate_online is not None:
        fields["rotate_online"] = tuple(p for p in args.rotate_online.split(",") if p)
    if args.weight_scale_search:
        fields["weight_scale_search"] = True
    try:
        config = fp4ptq.QuantConfig(**fields)
    except ConfigError as exc:
        raise CLIError(str(exc)) from exc
    output = Path(args.output) if args.output else OUT_ROOT / f"{_model_name(args.model)}-{_recipe_slug(config)}"
    # Every cheap check before the model loads: leftovers, output, device, model path, calibration data.
    from ..checkpoint import clean_leftovers
    from ..distributed import env_world
    from ..sources import resolve

    src = resolve(args.model)
    _check_output_apart(output, src)   # before anything touches the output: it must not hold the source
    if env_world().main:   # under torchrun, rank 0 alone touches the output's parent
        clean_leftovers(output)
    _prepare_output(output, args.overwrite, "output directory")
    device = _device(args.device)
    dtype = _dtype(args.dtype, device)
    if src.kind == "local" and _is_checkpoint(Path(src.path)):
        raise CLIError(f"{args.model} is already a quantized checkpoint (its config.json has a quantization_config); "
                       "quantize the full-precision model it was made from", EXIT_UNSUPPORTED)
    _check_calib(config, args.calib)
    skeleton = _skeleton(src) if args.ignore else None
    late_ignore = args.ignore   # checked on the loaded model where no skeleton could be built
    if skeleton is not None:   # --ignore checked and fused groups resolved before the weights load
        config = _resolve_fused_ignore(skeleton, config, args.ignore)
        late_ignore = None
    from .. import distributed

    # Under torchrun: every rank quantizes its share, rank 0 writes while the others wait.
    with distributed.launch(device) as (world, device), _quiet_other_ranks(world):
        path, model, config = _quantize_and_save(args, config, output, device, dtype, late_ignore)
    if not world.main:
        return EXIT_OK
    info = model.fp4ptq_info
    errors = [r["rel_error"] for r in info["layers"].values() if r.get("rel_error") is not None]
    size = sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))
    mean_err = f", mean weight rel. error {sum(errors) / len(errors):.4f}" if errors else ""
    stored = json.loads((Path(path) / "config.json").read_text())["fp4ptq"]["dtype"]
    ranks = (info.get("peak_memory") or {}).get("ranks", [])
    on_ranks = f" on {len(ranks)} ranks, rank 0's" if len(ranks) > 1 else ""
    per_rank = ("; peak per rank: " + ", ".join(_peak_text(r).removeprefix(", peak ") for r in ranks)
                if len(ranks) > 1 else "")
    print(f"quantized {len(info['layers'])} linears of {_model_name(args.model)} ({_recipe_text(config.to_dict())})"
          f"{mean_err}; {size / 2**20:.1f} MiB of tensors (unquantized ones in {stored}) in {path} "
          f"[{time.perf_counter() - started:.0f} s{on_ranks}{_peak_text(info.get('peak_memory'))}{per_rank}]. "
          f"Next: fp4ptq inspect {path}; "
          f"fp4ptq eval {path} --baseline {args.model or 'demo'} --tasks wikitext,arc_easy "
          "(add --data-dir DIR without hub access)")
    return EXIT_OK


@contextlib.contextmanager
def _quiet_other_ranks(world):
    """Ranks other than 0 keep quiet: no warnings (rank 0 warns about the same layers) and no
    library progress bars (transformers' weight loading), as with --quiet."""
    import warnings


    with warnings.catch_warnings(), _quiet_libraries(not world.main):
        if not world.main:
            warnings.simplefilter("ignore")
        yield


def _quantize_and_save(args, config, output: Path, device: str, dtype, late_ignore=None):
    """Load, quantize (under torchrun: this rank's share) and save (rank 0 only);
    ``(path or None, model, config)``. ``late_ignore``: --ignore patterns still to check on the loaded model."""
    import fp4ptq

    from ..distributed import world
    from ..sources import check_finite_weights, load_source_model

    _say(f"loading {args.model or 'the demo model (SmolLM2-135M-Instruct)'} ...")
    try:
        model, tokenizer, src = load_source_model(args.model, dtype=dtype, device="cpu")
    except ValueError as exc:
        raise CLIError(f"{args.model} is not a causal language model transformers can load ({exc})",
                       EXIT_UNSUPPORTED) from exc
    check_finite_weights(model, src)
    if late_ignore:   # sources without a skeleton (GGUF, an unreachable hub config): checked on the model
        config = _resolve_fused_ignore(model, config, late_ignore)
    calib_note = f", calibration {config.calib} {config.nsamples}x{config.seqlen}" if config.needs_calibration else ""
    w = world()
    ranks = f" x {w.size} ranks ({w.backend})" if w.parallel else ""
    _say(f"quantizing: {_recipe_text(config.to_dict())}{calib_note}, on {device}{ranks}")
    fp4ptq.quantize(model, config, tokenizer=tokenizer, device=device, progress=not args.quiet)
    model.fp4ptq_info["source"] = src.as_dict()
    if not w.main:
        return None, model, config
    save_dtype = None if args.dtype == "auto" else _dtype(args.dtype, device)   # None: the source's dtype
    _say(f"saving ({args.format}) to {output} ...")
    path = fp4ptq.save(model, output, tokenizer=tokenizer, overwrite=args.overwrite, format=args.format,
                       dtype=save_dtype)
    return path, model, config


def _peak_text(peak: Optional[dict]) -> str:
    """", peak 1.2 GiB host / 3.4 GiB GPU" from the quantization record's peak memory."""
    if not peak:
        return ""
    parts = [f"{peak['host_rss_bytes'] / 2**30:.1f} GiB host"] if peak.get("host_rss_bytes") else []
    if peak.get("device_bytes") is not None:
        parts.append(f"{peak['device_bytes'] / 2**30:.1f} GiB GPU")
    return ", peak " + " / ".join(parts) if parts else ""


def _check_output_apart(output: Path, src) -> None:
    """``-o`` must neither be, nor lie inside, nor hold the source model (directory or GGUF file):
    writing there (with ``--overwrite``: replacing it) would destroy the model being read."""
    if src.kind not in ("local", "gguf", "demo"):
        return
    source = Path(src.path).resolve()
    if src.gguf_file:
        source = source / src.gguf_file
    target = output.expanduser().resolve()
    if target == source:
        relation = "is"
    elif source.is_dir() and target.is_relative_to(source):
        relation = "lies inside"
    elif source.is_relative_to(target):
        relation = "holds"
    else:
        return
    harm = ("would write into the model's directory" if relation == "lies inside"
            else "would replace (--overwrite) or mix with the model being quantized")
    raise CLIError(f"-o/--output {output} {relation} the source model {source}: saving there {harm}; "
                   "choose an --output outside it", EXIT_USAGE)


def _skeleton(src):
    """The source model without weights (parameters on the meta device), built from its config.json,
    for checks before loading; None for GGUF files (their config lives in the GGUF metadata, which
    only the full load parses) and when the config cannot be read or built (the load reports it)."""
    if src.gguf_file:
        return None
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(src.path)
        with init_empty_weights(include_buffers=False):
            return AutoModelForCausalLM.from_config(config)
    except Exception:  # noqa: BLE001 - the full load that follows raises it with its exit code
        return None


def _check_calib(config, given: Optional[str]) -> None:
    """A local --calib source is read now (missing or empty: exit 3 before the model loads); a --calib
    the recipe does not use is said, not silently dropped."""
    from ..calib import DATA_FREE, HUB_SOURCES, local_documents

    if given is None:
        return
    if given not in HUB_SOURCES and given != DATA_FREE:
        local_documents(given)
    from ..distributed import env_world

    if not config.needs_calibration and env_world().main:   # said before the process group exists
        _say(f"note: --calib {given} is not used: {config.method} {config.scheme} needs no calibration data")


def _resolve_fused_ignore(model, config, patterns: Optional[list]):
    """--ignore of some members of a fused group (q/k/v, gate/up: one GEMM and one weight global
    scale in vLLM, SGLang, TensorRT-LLM) keeps the whole group in high precision, said here before
    any work; an --ignore pattern that matches no linear layer is a usage error."""
    import dataclasses

    from torch import nn

    from ..checkpoint import fused_ignore_extra

    linears = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    for pattern in patterns or []:
        probe = dataclasses.replace(config, ignore=(pattern,))
        if not any(probe.is_ignored(name) for name in linears):
            raise CLIError(f"--ignore {pattern} matches no linear layer of the model (names look like "
                           f"{linears[0] if linears else 'none'})")
    extra = fused_ignore_extra(model, config)
    if not extra:
        return config
    _say(f"--ignore keeps part of a fused group (q/k/v or gate/up share one GEMM and one scale in serving "
         f"engines): also keeping {len(extra)} layer(s) in high precision, e.g. {', '.join(extra[:3])}")
    return dataclasses.replace(config, ignore=tuple(config.ignore) + tuple(extra))

