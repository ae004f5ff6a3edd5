"""Whether a checkpoint on disk is the one that was saved, and damage named as such.

``save`` records in the report a hash per tensor (``checkpoint.tensor_xxh3_128``: XXH3-128 of its dtype,
shape and bytes as stored) and one of the config.json fields that decide how they are read
(``checkpoint.config_quantization_sha256`` over ``HASHED_CONFIG_KEYS``: the quantization config, the
fp4ptq record, the architecture; other fields, such as generation settings or
``max_position_embeddings``, may be edited). ``verify_hashes`` checks them (``load(verify=True)``,
``validate``, ``fp4ptq inspect``, ``fp4ptq eval``); when config.json carries the fp4ptq record, a
missing report, missing hashes or a wrong-typed field is damage, not "written by another tool". The
other checks here turn a damaged JSON file, report or config.json into a ``CheckpointError`` that says so.
"""
from __future__ import annotations

import hashlib
import json
import mmap
import os
import struct
from collections.abc import Iterable
from pathlib import Path
from typing import Optional

import xxhash

from .layout import (
    _QUANT_BUFFERS,
    CONFIG_FILE,
    CONFIG_HASH_KEY,
    HASHED_CONFIG_KEYS,
    HASHES_KEY,
    LEGACY_CONFIG_HASH_KEY,
    RECORD_KEY,
    REPORT_FILE,
    CheckpointError,
    checkpoint_files,
    read_headers,
)


def tensor_hashes(files: Iterable[str | Path], headers: Optional[dict] = None) -> dict:
    """``{tensor name: XXH3-128 hex}`` of each tensor's header dtype and shape and its bytes as stored in
    ``files`` (read through mmap, at the offsets the headers declare)."""
    headers = headers if headers is not None else read_headers(files)
    by_file: dict = {}
    for name, info in headers.items():
        by_file.setdefault(info.file, []).append((name, info))
    out = {}
    for file, entries in by_file.items():
        with open(file, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            view = b""   # no tensor bytes: mmap refuses an empty map
            if os.fstat(handle.fileno()).st_size > 8 + length:
                view = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
            try:
                with memoryview(view) as data:
                    for name, info in entries:
                        begin, end = info.offsets
                        digest = xxhash.xxh3_128(f"{info.dtype} {list(info.shape)}\n".encode())
                        digest.update(data[8 + length + begin: 8 + length + end])
                        out[name] = digest.hexdigest()
            finally:
                if not isinstance(view, bytes):
                    view.close()
    return out


def config_hash(config: dict, keys: Optional[tuple] = HASHED_CONFIG_KEYS) -> str:
    """SHA-256 of config.json's ``keys`` (None: all of it; key order and formatting do not count)."""
    if keys is not None:
        config = {key: config.get(key) for key in keys}
    text = json.dumps(config, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()


def read_json(file: Path) -> dict:
    if not file.is_file():
        raise CheckpointError(f"{file} is missing: not a checkpoint directory (or an incomplete copy)")
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise CheckpointError(f"{file} is not valid JSON ({exc}); the file is damaged") from exc


def _written_by_fp4ptq(headers: dict) -> bool:
    """Whether the safetensors files say ``fp4ptq.save`` wrote them (``__metadata__`` producer); a
    checkpoint re-saved by transformers' ``save_pretrained`` keeps config.json's fp4ptq record but
    neither the report nor that producer."""
    for file in sorted({info.file for info in headers.values()}):
        with open(file, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            metadata = json.loads(handle.read(length)).get("__metadata__") or {}   # read_headers checked it
        if metadata.get("producer") == "fp4ptq":
            return True
    return False


def _recovery() -> str:
    return ("Re-copy or re-create the checkpoint (fp4ptq.load(..., verify=False) or `fp4ptq eval --no-verify` "
            "accept it as it is)")


def verify_hashes(path: Path, headers: dict, report: Optional[dict]) -> Optional[int]:
    """Check the config.json fields that decide loading and every tensor (dtype, shape, bytes) against
    the hashes the report recorded at save time (swapped offsets, flipped bits, an edited quantization
    config); returns how many tensors were checked (None: a checkpoint of another tool, or one re-saved
    by transformers: no report, and not both config.json's fp4ptq record and files whose metadata names
    fp4ptq as producer). Otherwise a missing report, missing hashes or a wrong-typed field is a
    ``CheckpointError``: deleting them must not skip the check."""
    config = read_json(path / CONFIG_FILE)
    ours = isinstance(config, dict) and config.get(RECORD_KEY) is not None and _written_by_fp4ptq(headers)
    file = path / REPORT_FILE
    if report is None:
        if not ours:
            return None
        raise CheckpointError(f"{file} is missing, but {path / CONFIG_FILE} carries the {RECORD_KEY!r} record of "
                              f"fp4ptq.save: the tensor hashes to verify are gone. {_recovery()}")
    record = report.get("checkpoint")
    if not isinstance(record, dict):
        raise CheckpointError(f"{file}: field 'checkpoint' is {str(record)[:40]!r}, not an object holding the "
                              f"tensor hashes; the file is damaged. {_recovery()}")
    recorded = record.get(HASHES_KEY)
    if not isinstance(recorded, dict) or not all(isinstance(v, str) for v in recorded.values()):
        what = "missing" if recorded is None else f"{type(recorded).__name__}, not an object of hex digests"
        raise CheckpointError(f"{file}: field checkpoint.{HASHES_KEY} is {what}; the file is damaged. {_recovery()}")
    if CONFIG_HASH_KEY in record:
        saved, actual_config, what = record[CONFIG_HASH_KEY], config_hash(config), "the quantization fields of "
    elif LEGACY_CONFIG_HASH_KEY in record:   # checkpoints saved before only the loading fields were hashed
        saved, actual_config, what = record[LEGACY_CONFIG_HASH_KEY], config_hash(config, None), ""
    else:
        raise CheckpointError(f"{file}: field checkpoint.{CONFIG_HASH_KEY} is missing; the file is damaged. "
                              f"{_recovery()}")
    problems = []
    if saved != actual_config:
        fields = ", ".join(HASHED_CONFIG_KEYS) if what else "any field"
        problems.append(f"{what}{CONFIG_FILE} differ from the ones saved ({fields}; edited after saving?)")
    if set(recorded) != set(headers):
        missing, extra = sorted(set(recorded) - set(headers)), sorted(set(headers) - set(recorded))
        problems.append(f"the files lack {missing[:5]}" if missing else f"the files hold unrecorded {extra[:5]}")
    actual = tensor_hashes([], headers)
    bad = sorted(n for n in actual if n in recorded and recorded[n] != actual[n])
    if bad:
        problems.append(f"{len(bad)} tensor(s) whose bytes differ from the ones saved, e.g. "
                        + ", ".join(f"{n} in {Path(headers[n].file).name}" for n in bad[:3]))
    if problems:
        raise CheckpointError(f"{path}: integrity check failed against {REPORT_FILE}: " + "; ".join(problems)
                              + f". The checkpoint is damaged or was edited after saving. {_recovery()}")
    return len(actual)


def check_packed_has_config(path: Path) -> None:
    """A model directory whose safetensors files hold packed NVFP4 tensors must say how to read them:
    without a valid ``quantization_config`` it is damaged, not a full-precision model."""
    config = read_json(path / CONFIG_FILE)
    if isinstance(config.get("quantization_config"), dict):
        return
    try:
        files = checkpoint_files(path)
    except CheckpointError:
        return   # no safetensors files here: nothing packed to misread
    packed = sorted((not n.endswith(".weight_packed"), n) for n in read_headers(files)
                    if n.rpartition(".")[2] in _QUANT_BUFFERS)
    packed = [n for _, n in packed]
    if packed:
        raise CheckpointError(
            f"{path / CONFIG_FILE} has no quantization_config, but the files hold packed NVFP4 tensors "
            f"({packed[0]}, ...): the checkpoint's config.json is damaged or was replaced. Restore the "
            "config.json that fp4ptq.save wrote (or re-create the checkpoint)")


def _number_or_none(value) -> bool:
    return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool))


def _report_problem(report: dict) -> Optional[str]:
    """The first report field (what inspect, eval and the CLI read) of the wrong type, or None."""
    for key in ("checkpoint", "config", "calibration", "rotation", "keep"):
        if report.get(key) is not None and not isinstance(report[key], dict):
            return f"field {key!r} is {type(report[key]).__name__}, not an object"
    config = report.get("config")
    if config is not None:
        for key in ("method", "scheme"):
            if not isinstance(config.get(key), str):
                return f"field config.{key} is {config.get(key)!r}, not a name"
    high = report.get("high_precision")
    if high is not None and not (isinstance(high, dict) and all(isinstance(v, str) for v in high.values())):
        return f"field 'high_precision' is {str(high)[:40]!r}, not an object of {{layer: reason}}"
    layers = report.get("layers")
    if layers is not None and not isinstance(layers, dict):
        return f"field 'layers' is {type(layers).__name__}, not an object of {{layer: record}}"
    for name, rec in (layers or {}).items():
        if not isinstance(rec, dict):
            return f"field layers.{name} is {type(rec).__name__}, not an object"
        shape = rec.get("shape")
        if shape is not None and not (isinstance(shape, list)
                                      and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                              for d in shape)):
            return f"field layers.{name}.shape is {shape!r}, not a list of sizes"
        for key in ("rel_error", "four_share"):
            if not _number_or_none(rec.get(key)):
                return f"field layers.{name}.{key} is {rec.get(key)!r}, not a number"
        if rec.get("scheme") is not None and not isinstance(rec["scheme"], str):
            return f"field layers.{name}.scheme is {rec['scheme']!r}, not a name"
    return None


def read_report_checked(path: Path) -> Optional[dict]:
    """``read_report`` with a damaged report (bad JSON, not an object, a field of the wrong type) as a
    ``CheckpointError`` naming the file and the field."""
    file = path / REPORT_FILE
    if not file.is_file():
        return None
    report = read_json(file)
    if not isinstance(report, dict):
        raise CheckpointError(f"{file} is not a JSON object; the file is damaged")
    problem = _report_problem(report)
    if problem:
        raise CheckpointError(f"{file}: {problem}; the file is damaged. Re-copy or re-create the checkpoint")
    return report
