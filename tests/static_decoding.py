"""Static-cache decoding as transformers' compiled ``generate`` runs it, eagerly and compiled (shared by
the tests that compare the two)."""
from __future__ import annotations

import torch


def eager_and_compiled_steps(model, vocab: int, steps: int = 3):
    """Logits of ``steps`` greedy steps after an 8-token prompt (a static cache written in place, one
    token a step), with the step eager and through ``torch.compile`` (aot_eager)."""
    from transformers import StaticCache

    prompt = torch.randint(0, vocab, (1, 8), generator=torch.Generator().manual_seed(3))
    cache = StaticCache(config=model.config, max_cache_len=32)

    def decode(step):
        cache.reset()
        logits = model(input_ids=prompt, past_key_values=cache, use_cache=True).logits[:, -1]
        out = []
        for _ in range(steps):
            logits = step(logits.argmax(-1, keepdim=True))
            out.append(logits)
        return torch.stack(out)

    def step(token):
        return model(input_ids=token, past_key_values=cache, use_cache=True).logits[:, -1]

    torch._dynamo.reset()
    with torch.no_grad():
        return decode(step), decode(torch.compile(step, backend="aot_eager"))
