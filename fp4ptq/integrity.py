"""Whether a checkpoint on disk is the one that was saved, and damage named as such.

``save`` records in the report a hash per tensor (``checkpoint.tensor_xxh3_128``: XXH3-128 of its dtype,
shape and bytes as stored) and one of config.json (``checkpoint.config_sha256``); ``verify_hashes``
checks them (``load(verify=True)``, ``validate``, ``fp4ptq inspect``, ``fp4ptq eval``). The other checks
here turn a damaged JSON file, report or config.json into a ``CheckpointError`` that says so.
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
    HASHES_KEY,
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


def config_hash(config: dict) -> str:
    """SHA-256 of config.json's content (key order and formatting do not count)."""
    text = json.dumps(config, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()


def read_json(file: Path) -> dict:
    if not file.is_file():
        raise CheckpointError(f"{file} is missing: not a checkpoint directory (or an incomplete copy)")
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{file} is not valid JSON ({exc}); the file is damaged") from exc


def verify_hashes(path: Path, headers: dict, report: Optional[dict]) -> Optional[int]:
    """Check config.json and every tensor (dtype, shape, bytes) against the hashes the report
    recorded at save time (swapped offsets, flipped bits, an edited field); returns how many tensors
    were checked (None: the checkpoint records no hashes, e.g. one written by another tool)."""
    record = (report or {}).get("checkpoint") or {}
    recorded = record.get(HASHES_KEY) if isinstance(record, dict) else None
    if recorded is None:
        return None
    if not isinstance(recorded, dict):
        raise CheckpointError(f"{path / REPORT_FILE}: field checkpoint.{HASHES_KEY} is not an object; the file is damaged")
    problems = []
    if record.get(CONFIG_HASH_KEY) != config_hash(read_json(path / CONFIG_FILE)):
        problems.append(f"{CONFIG_FILE} differs from the one saved (edited after saving?)")
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
                              + ". The checkpoint is damaged or was edited after saving; re-copy or re-create it "
                              "(fp4ptq.load without verify=True accepts it as it is)")
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


def read_report_checked(path: Path) -> Optional[dict]:
    """``read_report`` with a damaged report as a ``CheckpointError``."""
    file = path / REPORT_FILE
    if not file.is_file():
        return None
    report = read_json(file)
    if not isinstance(report, dict):
        raise CheckpointError(f"{file} is not a JSON object; the file is damaged")
    return report

