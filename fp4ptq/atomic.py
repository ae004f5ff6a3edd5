"""Writing a checkpoint directory atomically: into a hidden sibling, renamed into place when
complete; leftovers of a killed run found and removed; ``--overwrite`` only replaces model outputs."""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

from .layout import CONFIG_FILE, REPORT_FILE, CheckpointError

_log = logging.getLogger("fp4ptq")

# --------------------------------------------------------------------------- #
# Atomic directory
# --------------------------------------------------------------------------- #
def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def is_model_output(path: Path) -> bool:
    """Whether ``overwrite`` may replace the directory ``path``: empty, or a model as fp4ptq or
    Hugging Face write them (a ``config.json`` or an fp4ptq report)."""
    return not any(path.iterdir()) or (path / CONFIG_FILE).is_file() or (path / REPORT_FILE).is_file()


def _check_target(target: Path, overwrite: bool) -> None:
    if target.exists() and not target.is_dir():
        raise CheckpointError(f"{target} exists and is not a directory; choose another output path")
    if target.is_dir() and any(target.iterdir()):
        if not overwrite:
            raise CheckpointError(
                f"{target} already exists and is not empty; pass overwrite=True (CLI: --overwrite) to replace it"
            )
        if not is_model_output(target):
            raise CheckpointError(
                f"{target} is not a model directory (no {CONFIG_FILE} nor {REPORT_FILE}) and is not empty: "
                "overwrite only replaces an earlier checkpoint; choose another output path"
            )


# A live save's hidden directories carry its process id: ``.NAME.partial-<pid>-<hex8>``.
_LEFTOVER = re.compile(r"\.(?P<kind>partial|replaced)-(?:(?P<pid>\d+)-)?[0-9a-f]{8}$")
LIVE_SAVE_SECONDS = 3600   # a live process's directory untouched this long is a leftover (its pid reused)


def _hidden_name(target: Path, kind: str) -> Path:
    return target.parent / f".{target.name}.{kind}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _live_save(leftover: Path, pid: Optional[str]) -> bool:
    """Whether ``leftover`` belongs to a save still running: its process is alive and it was written
    to within ``LIVE_SAVE_SECONDS`` (names without a pid, from older versions, are leftovers)."""
    if pid is None:
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        pass   # alive, another user's (or a pid out of range: treated as alive, then aged out)
    newest = max((f.stat().st_mtime for f in [leftover, *leftover.rglob("*")]), default=0.0)
    return time.time() - newest < LIVE_SAVE_SECONDS


def clean_leftovers(target: str | Path) -> list:
    """Remove what a killed save into ``target`` left beside it: ``.NAME.partial-*`` directories, and
    ``.NAME.replaced-*`` ones (the previous checkpoint, set aside just before the final rename: it is
    put back as ``NAME`` when ``NAME`` is missing). Those of a save still running (its process alive,
    written to within the hour) are left alone, with a line saying so. Returns the lines it logged."""
    target = Path(target).expanduser().absolute()
    if not target.parent.is_dir():
        return []
    lines = []
    for kind in ("replaced", "partial"):
        for leftover in sorted(target.parent.glob(f".{_glob_escape(target.name)}.{kind}-*")):
            match = _LEFTOVER.search(leftover.name)
            if not leftover.is_dir() or match is None:
                continue
            if _live_save(leftover, match["pid"]):
                lines.append(f"left {leftover} alone: a save by running process {match['pid']} is writing it")
            elif kind == "replaced" and not target.exists():
                os.rename(leftover, target)
                lines.append(f"put back {target} from {leftover.name} (a save into it was interrupted)")
            else:
                size = sum(f.stat().st_size for f in leftover.rglob("*") if f.is_file())
                shutil.rmtree(leftover)
                lines.append(f"removed {leftover} ({size / 2**20:.1f} MiB), left by an interrupted save")
    for line in lines:
        _log.warning("fp4ptq: %s", line)
    return lines


def _glob_escape(name: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", name)


@contextmanager
def atomic_directory(target: str | Path, overwrite: bool = False):
    """Yield a fresh hidden directory beside ``target``; on success fsync its
    files and rename it to ``target`` (replacing it only with ``overwrite``);
    on error remove it. A killed process leaves ``.NAME.partial-PID-XXXXXXXX``."""
    target = Path(target).expanduser().absolute()
    clean_leftovers(target)
    _check_target(target, overwrite)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = _hidden_name(target, "partial")
    os.mkdir(partial)
    try:
        yield partial
        for file in partial.rglob("*"):
            if file.is_file():
                _fsync_path(file)
        _fsync_path(partial)
        _check_target(target, overwrite)
        previous = None
        if target.is_dir():
            previous = _hidden_name(target, "replaced")
            os.rename(target, previous)
        os.rename(partial, target)
        _fsync_path(target.parent)
        if previous is not None:
            shutil.rmtree(previous)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


