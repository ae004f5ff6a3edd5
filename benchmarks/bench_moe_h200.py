"""A Mixture-of-Experts layer's experts on the H200: the grouped NVFP4 kernel (``fp4ptq/kernels/grouped.py``)
against the same layer in bf16 (issue 44, item 1).

Layers: Qwen3-30B-A3B-shaped (128 experts, top-8, hidden 2048, expert FFN 768) and Mixtral-shaped (8 experts,
top-2, hidden 4096, FFN 14336), at 1, 16, 256 and 4096 tokens routed uniformly at random (distinct experts per
token, softmax weights; seeded). Each implementation runs the whole experts computation: sorting the
(token, slot) pairs by expert, gate + up, the SwiGLU gating, down and the weighted sum of each token's k rows.

* ``w4a16``, ``w4a4``, ``w4a4_46`` (W4A4 with Four Over Six activations, rule mse): ``fp4ptq.kernels.moe_experts``
  with the fused SwiGLU gating (``gate="silu"``): two grouped launches (w13 fused) reading only the experts with
  tokens, K split at decode where the grid is short of programs (``grouped.split_for``; the gating and the
  combine add the partial sums), and for W4A16 on 128-row tiles (prefill) the active experts dequantized, then
  ``torch._grouped_mm`` (``grouped_dequant.py``); ``w4a16_w13_path`` / ``w4a16_w2_path`` in the results say
  which ran ("kernel <BLOCK_N>x<BLOCK_K> S=<K slices>" or "dequant"); W4A4 quantizes each pair's activation
  row once first (``grouped.quantize_pairs``, one launch a projection: "quantize+kernel ..."), timed alone, w13's
  and w2's together, in ``w4a4_prologue_us`` / ``w4a4_46_prologue_us``;
* ``bf16``: the same glue (``grouped.route``'s kernels, the fused gating ``grouped.swiglu``, ``grouped.combine``'s
  kernel) around ``torch._grouped_mm`` (torch's grouped GEMM, where the installed torch has it; ``bf16_impl`` in
  the results says which ran) or else one cuBLAS call per expert with tokens (the routing is fixed for the timed
  graph, so the host knows each expert's rows): only the GEMMs differ.

Each row also times the glue alone: ``route_us`` / ``combine_us`` (the Triton kernels both layers use) against
``route_torch_us`` / ``combine_torch_us`` (``route_reference`` / ``combine_reference``, the torch ops they replace),
and ``route_equal`` / ``combine_equal``: the kernels' outputs equal the torch ops' (every field; bit for bit).

Every time is the median of CUDA-graph replays of 10 calls (``harness.graph_us``), the peers interleaved in
``ROUNDS`` rounds. Before timing, each output is checked against its reference: ours against the loop over
experts through ``nvfp4.py`` (``grouped_linear_reference``; relative Frobenius error < 1e-2, the dense kernels'
tolerance), bf16 against fp32 on the same weights. Goals (issue 44): >= 2.5x bf16 at decode sizes (1 and 16
tokens) and >= 0.9x at 4096 tokens (W4A16). (``*_w13_rel_err``: the gate + up launch alone against the reference,
the kernel's own tolerance; ``*_rel_err``: the whole layer, where W4A4 re-quantizes the gated activations, so an
output a rounding apart can flip a code of the down projection's input and the layer's error is larger.)

    PYTHONPATH=$PWD PEERS_DIR=.peers python benchmarks/bench_moe_h200.py   # $OUT/moe_h200.{json,md,png}

Knobs: ``--layers qwen3,mixtral``, ``--tokens 1,16,256,4096``, ``--rounds 3``, ``--name moe_h200``. The report
alone (any machine, no GPU): ``python benchmarks/bench_moe_h200.py --report results.json`` rewrites the
markdown table and the figure beside the JSON file. ``--sweep --name moe_sweep_h200``: where the time goes (routing,
each launch, the whole layer) and the grouped kernel's tile sweep, W4A16 (``SWEEP_CONFIGS``), each decode launch
(16-row tiles) at every K split of ``--splits`` (the launch alone, writing its partials), and from 256 tokens
the prefill path (dequantize + grouped GEMM) against the kernel.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import harness

LAYERS = {  # name: (experts, top-k, hidden, expert FFN)
    "qwen3": (128, 8, 2048, 768),
    "mixtral": (8, 2, 4096, 14336),
}
LABELS = {"qwen3": "Qwen3-30B-A3B", "mixtral": "Mixtral-8x7B"}
TOKENS = (1, 16, 256, 4096)
SCHEMES = ("w4a16", "w4a4", "w4a4_46")
DECODE_MAX_TOKENS = 16
GOALS = {"decode": 2.5, "prefill_4096": 0.9}


def _routing(tokens: int, experts: int, k: int, device, gen):
    import torch

    logits = torch.randn(tokens, experts, device=device, generator=gen)
    weights, index = logits.topk(k, dim=-1)
    return index, torch.softmax(weights, dim=-1).to(torch.bfloat16)


def _bf16_layer(w13, w2):
    """The bf16 experts: the same routing, gating and combine as ours (``grouped.route``, ``grouped.swiglu``,
    ``grouped.combine``) around torch's grouped GEMM (or a loop of cuBLAS calls). Returns ``(impl name,
    make(hidden, index, weights) -> fn)``."""
    import torch

    from fp4ptq.kernels import grouped

    has_grouped_mm = hasattr(torch, "_grouped_mm")

    def make(hidden, index, weights, impl):
        experts = w13.shape[0]
        counts = None
        if impl == "loop":  # (the routing is fixed: the host knows each expert's rows before the capture)
            r = grouped.route(index, experts)
            counts = (r.offsets[1:] - r.offsets[:-1]).tolist()

        def mm(x, w, offs):
            if impl == "grouped_mm":  # [P, K] x [E, K, N] (the weights' transposed view) by groups of rows
                return torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
            out = x.new_empty((x.shape[0], w.shape[1]))
            lo = 0
            for e, c in enumerate(counts):
                if c:
                    torch.mm(x[lo:lo + c], w[e].t(), out=out[lo:lo + c])
                lo += c
            return out

        def fn():
            rr = grouped.route(index, experts)
            offs = rr.offsets[1:]
            h = mm(hidden[rr.token.long()], w13, offs)
            y = mm(grouped.swiglu(h, rr, hidden.dtype), w2, offs)
            return grouped.combine(y, rr, weights, hidden.dtype)
        return fn

    return ("grouped_mm" if has_grouped_mm else "loop"), make


def run(args) -> dict:
    import torch

    from fp4ptq import kernels, nvfp4
    from fp4ptq.kernels import grouped

    dev = torch.device(args.device)
    t0 = time.time()
    peers = harness.peers()
    res = {"env": peers.env(), "goals": GOALS, "rounds": args.rounds, "rows": []}
    path = harness.out_path(args.name + ".json")
    save, record = harness.recorder(res, path)
    gen = torch.Generator(device=dev).manual_seed(0)

    def gate(g, u):
        return torch.nn.functional.silu(g) * u

    for layer in args.layers:
        experts, k, hidden_size, ffn = LAYERS[layer]
        w13f = torch.randn(experts, 2 * ffn, hidden_size, device=dev, generator=gen) * 0.02
        w2f = torch.randn(experts, hidden_size, ffn, device=dev, generator=gen) * 0.02
        # one global scale per expert for gate and up together (w13), as fp4ptq.quantize stores them
        q13 = [nvfp4.quantize(w13f[e]) for e in range(experts)]
        q2 = [nvfp4.quantize(w2f[e]) for e in range(experts)]
        w13b = torch.stack([q.dequantize(torch.bfloat16) for q in q13])   # bf16 peer: the same weights
        w2b = torch.stack([q.dequantize(torch.bfloat16) for q in q2])
        del w13f, w2f
        stacks = {}
        for scheme in SCHEMES:
            amax13 = [torch.tensor(8.0)] * experts if scheme != "w4a16" else None
            amax2 = [torch.tensor(4.0)] * experts if scheme != "w4a16" else None
            rule = "mse" if scheme == "w4a4_46" else None
            stacks[scheme] = (grouped.stack_weights(q13, input_amax=amax13, four_six=rule),
                              grouped.stack_weights(q2, input_amax=amax2, four_six=rule))
        del q13, q2
        impl, make_bf16 = _bf16_layer(w13b, w2b)
        for tokens in args.tokens:
            index, weights = _routing(tokens, experts, k, dev, gen)
            hidden = torch.randn(tokens, hidden_size, device=dev, generator=gen).to(torch.bfloat16)
            row = {"layer": layer, "experts": experts, "top_k": k, "hidden": hidden_size, "ffn": ffn,
                   "tokens": tokens, "active_experts": int(index.unique().numel()), "bf16_impl": impl}
            fns = {}
            for scheme, (s13, s2) in stacks.items():
                def ours(s13=s13, s2=s2, hidden=hidden, index=index, weights=weights):
                    return kernels.moe_experts(hidden, index, weights, s13, s2, "silu")
                ref = grouped.moe(hidden, index, weights, s13, s2, "silu", backend="reference")
                row[f"{scheme}_rel_err"] = harness.rel(ours(), ref)
                r = grouped.route(index, experts)  # the kernel alone on w13 (the dense kernels' tolerance: 1e-2)
                for proj, sw in (("w13", s13), ("w2", s2)):  # (w2 reads hidden's dtype and device too)
                    row[f"{scheme}_{proj}_path"] = _path(hidden, r, sw)
                if scheme != "w4a16":  # W4A4's prologues alone (each pair's row quantized once, w13 and w2)
                    act = torch.randn(r.pairs, ffn, device=dev).to(torch.bfloat16)
                    row[f"{scheme}_prologue_us"] = harness.graph_us(lambda s13=s13, s2=s2, act=act, r=r, hidden=hidden: (
                        grouped.quantize_pairs(hidden, r, s13), grouped.quantize_pairs(act, r, s2, gather=False)))
                row[f"{scheme}_w13_rel_err"] = harness.rel(
                    grouped.grouped_linear(hidden, r, s13)[r.valid], grouped.grouped_linear_reference(hidden, r, s13)[r.valid])
                replays = harness.graph_replays(ours, 2)
                row[f"{scheme}_graph_equal"] = all(torch.equal(replays[0], o) for o in replays)
                fns[scheme] = ours
            bf16 = make_bf16(hidden, index, weights, impl)
            try:
                y = bf16()
            except Exception as exc:  # noqa: BLE001 - torch._grouped_mm refused: the loop of cuBLAS calls
                row["bf16_grouped_mm_error"] = repr(exc)[:300]
                row["bf16_impl"] = "loop"
                bf16 = make_bf16(hidden, index, weights, "loop")
                y = bf16()
            if tokens <= 256:
                with torch.no_grad():
                    row["bf16_rel_err"] = harness.rel(y, _fp32_layer(hidden, index, weights, w13b, w2b, gate))
            fns["bf16"] = bf16
            row.update(_glue_times(hidden, index, weights, experts))
            times = harness.interleaved(fns, args.rounds)
            for label, us in times.items():
                row[f"{label}_us"] = us
            for scheme in SCHEMES:
                if isinstance(times.get(scheme), float) and isinstance(times.get("bf16"), float):
                    row[f"{scheme}_x_bf16"] = times["bf16"] / times[scheme]
            record("rows", row)
        del stacks, w13b, w2b
        torch.cuda.empty_cache()
    res["seconds"] = time.time() - t0
    save()
    write_reports(res, path)
    return res


def _path(x, routing, weight) -> str:
    """The path ``grouped_linear`` takes for this launch: "dequant" or "kernel <BLOCK_N>x<BLOCK_K> S=<K slices>"
    ("quantize+kernel ..." for W4A4: the prologue first)."""
    from fp4ptq.kernels import grouped

    path, tile, slices, _ = grouped.launch_plan(x, routing, weight)
    return path if path == "dequant" else f"{path} {tile[0]}x{tile[1]} S={slices}"


def _glue_times(hidden, index, weights, experts) -> dict:
    """The routing and the combine alone: the kernels (both layers' glue) and the torch ops they replace,
    and whether the kernels' outputs equal the torch ops' (every ``Routing`` field; the combine bit for bit)."""
    import torch

    from fp4ptq.kernels import grouped

    r = grouped.route(index, experts)
    ref = grouped.route_reference(index, experts)
    y = torch.randn(r.pairs, hidden.shape[1], device=hidden.device).to(hidden.dtype)
    same = all(torch.equal(getattr(r, f), getattr(ref, f)) and getattr(r, f).dtype == getattr(ref, f).dtype
               for f in ("order", "token", "offsets", "tile_expert", "tile_row", "valid", "position"))
    return {"route_equal": same and r.block_m == ref.block_m,
            "combine_equal": torch.equal(grouped.combine(y, r, weights), grouped.combine_reference(y, r, weights)),
            "route_us": harness.graph_us(lambda: grouped.route(index, experts)),
            "route_torch_us": harness.graph_us(lambda: grouped.route_reference(index, experts)),
            "combine_us": harness.graph_us(lambda: grouped.combine(y, r, weights)),
            "combine_torch_us": harness.graph_us(lambda: grouped.combine_reference(y, r, weights))}


def _silu_gate(g, u):
    import torch

    return torch.nn.functional.silu(g) * u


# (BLOCK_N, BLOCK_K, num_warps, num_stages) tried by --sweep beside ``grouped.kernel_config``'s pick
SWEEP_CONFIGS = ((16, 256, 4, 4), (32, 128, 4, 4), (32, 256, 4, 3), (64, 64, 4, 4), (64, 128, 4, 4),
                 (64, 256, 4, 3), (64, 128, 8, 3), (128, 64, 4, 3), (128, 64, 8, 4), (128, 128, 8, 3),
                 (128, 128, 4, 3), (256, 64, 8, 3))
# the decode tiles whose K splits --sweep times beside the pick's (grouped.DECODE_*)
SPLIT_TILES = ((32, 256, 4, 3), (64, 256, 4, 3), (64, 128, 4, 4), (32, 128, 4, 4))
SPLITS = (1, 2, 3, 4, 6, 8)


def sweep(args) -> dict:
    """Where a layer's time goes and which tile and split the grouped kernel wants (W4A16): ``route`` alone,
    the whole layer (fused gating, and with the torch gating), each projection's launch alone under
    ``kernel_config``'s pick and under every ``SWEEP_CONFIGS`` tile without a K split (each checked against
    the default output first), at decode (16-row tiles) each ``--splits`` K split under the pick and
    ``SPLIT_TILES`` (the launch alone, writing its fp32 partials), torch's grouped GEMM on the same rows in
    bf16, and (>= 256 tokens) the prefill path: the active experts dequantized, then that grouped GEMM."""
    import torch

    from fp4ptq import nvfp4
    from fp4ptq.kernels import grouped

    dev = torch.device(args.device)
    t0 = time.time()
    res = {"env": harness.peers().env(), "configs": SWEEP_CONFIGS, "splits": args.splits, "rows": []}
    path = harness.out_path(args.name + ".json")
    save, record = harness.recorder(res, path)
    gen = torch.Generator(device=dev).manual_seed(0)

    def timed(fn, want, valid) -> object:
        try:
            err = harness.rel(grouped.sum_partials(fn())[valid], want)
            return harness.graph_us(fn) if err < 1e-2 else f"rel. error {err:.2e}"
        except Exception as exc:  # noqa: BLE001 - a tile that does not compile or fit: recorded
            return repr(exc)[:200]

    for layer in args.layers:
        experts, k, hidden_size, ffn = LAYERS[layer]
        qs, bf = {}, {}
        for proj, (n_, k_) in {"w13": (2 * ffn, hidden_size), "w2": (hidden_size, ffn)}.items():
            w = torch.randn(experts, n_, k_, device=dev, generator=gen) * 0.02
            q = [nvfp4.quantize(w[e]) for e in range(experts)]
            bf[proj] = torch.stack([t.dequantize(torch.bfloat16) for t in q])
            qs[proj] = grouped.stack_weights(q)
            del w, q
        for tokens in args.tokens:
            if time.time() - t0 > args.budget:
                break
            index, weights = _routing(tokens, experts, k, dev, gen)
            hidden = torch.randn(tokens, hidden_size, device=dev, generator=gen).to(torch.bfloat16)
            r = grouped.route(index, experts)
            inter = torch.randn(r.pairs, ffn, device=dev, generator=gen).to(torch.bfloat16)
            offs = r.offsets[1:]
            row = {"layer": layer, "tokens": tokens, "block_m": r.block_m,
                   "route_us": harness.graph_us(lambda: grouped.route(index, experts)),
                   "route_torch_us": harness.graph_us(lambda: grouped.route_reference(index, experts)),
                   "layer_us": harness.graph_us(lambda: grouped.moe(hidden, index, weights, qs["w13"], qs["w2"], "silu")),
                   "layer_torch_gating_us": harness.graph_us(
                       lambda: grouped.moe(hidden, index, weights, qs["w13"], qs["w2"], _silu_gate))}
            for proj, (x, gather) in {"w13": (hidden, True), "w2": (inter, False)}.items():
                sw = qs[proj]
                row[f"{proj}_path"] = _path(x, r, sw)
                row[f"{proj}_us"] = harness.graph_us(lambda x=x, sw=sw, gather=gather: grouped.grouped_linear(
                    x, r, sw, gather=gather, partials=True))
                want = grouped.grouped_linear(x, r, sw, gather=gather, path="kernel", split=1)[r.valid].float()
                times = {}
                for cfg in (None,) + SWEEP_CONFIGS:
                    times[str(cfg)] = timed(lambda cfg=cfg, x=x, sw=sw, gather=gather: grouped.grouped_linear(
                        x, r, sw, gather=gather, config=cfg, split=1, path="kernel"), want, r.valid)
                ok = {c: t for c, t in times.items() if isinstance(t, float)}
                best = min(ok, key=ok.get) if ok else None
                row[f"{proj}_pick_us"] = times["None"]
                row[f"{proj}_best"] = best
                row[f"{proj}_best_us"] = ok.get(best)
                row[f"{proj}_all"] = times
                if r.block_m == 16:  # decode: every K split under the pick and SPLIT_TILES (partials, no sum)
                    splits = {}
                    for cfg in (None,) + SPLIT_TILES:
                        for s in args.splits:
                            splits[f"{cfg} S={s}"] = timed(
                                lambda cfg=cfg, s=s, x=x, sw=sw, gather=gather: grouped.grouped_linear(
                                    x, r, sw, gather=gather, config=cfg, split=s, path="kernel", partials=True),
                                want, r.valid)
                    ok = {c: t for c, t in splits.items() if isinstance(t, float)}
                    row[f"{proj}_splits"] = splits
                    row[f"{proj}_best_split"] = min(ok, key=ok.get) if ok else None
                    row[f"{proj}_best_split_us"] = ok.get(row[f"{proj}_best_split"])
                xg = hidden[r.token.long()] if gather else x
                wt = bf[proj].transpose(-2, -1)
                row[f"{proj}_bf16_grouped_mm_us"] = harness.graph_us(lambda xg=xg, wt=wt: torch._grouped_mm(xg, wt, offs=offs))
                if tokens >= 256:
                    row[f"{proj}_dequant_grouped_mm_us"] = timed(
                        lambda x=x, sw=sw, gather=gather: grouped.grouped_linear(x, r, sw, gather=gather, path="dequant"),
                        want, r.valid)
            record("rows", row)
        qs.clear()   # free the layer's weights before the next (the lambdas above read qs)
        bf.clear()
        torch.cuda.empty_cache()
    res["seconds"] = time.time() - t0
    save()
    return res


def _fp32_layer(hidden, index, weights, w13, w2, gate):
    """The exact layer in fp32 (token by token over its k experts) for the bf16 peer's error."""
    import torch

    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    inter = w13.shape[1] // 2
    for e in index.unique().tolist():
        t, s = torch.where(index == e)
        h = hidden[t].float() @ w13[e].float().t()
        y = gate(h[:, :inter], h[:, inter:]) @ w2[e].float().t()
        out.index_add_(0, t, y * weights[t, s, None].float())
    return out


# --------------------------------------------------------------------------- #
# Reports (any machine)
# --------------------------------------------------------------------------- #
def _us(v) -> str:
    return f"{v:.1f}" if isinstance(v, (int, float)) else "failed"


def _x(v) -> str:
    return f"{v:.2f}x" if isinstance(v, (int, float)) else "-"


def verdicts(res: dict) -> list:
    """(goal, figure, met) for each of issue 44's goals that the rows measure (W4A16 against bf16)."""
    out = []
    for layer in dict.fromkeys(r["layer"] for r in res["rows"]):
        rows = [r for r in res["rows"] if r["layer"] == layer]
        decode = [r.get("w4a16_x_bf16") for r in rows if r["tokens"] <= DECODE_MAX_TOKENS]
        if decode and all(isinstance(v, float) for v in decode):
            worst = min(decode)
            goal = f"{LABELS.get(layer, layer)}: decode (<= {DECODE_MAX_TOKENS} tokens) >= {GOALS['decode']}x bf16"
            out.append((goal, f"{worst:.2f}x (worst)", worst >= GOALS["decode"]))
        big = [r.get("w4a16_x_bf16") for r in rows if r["tokens"] == 4096]
        if big and isinstance(big[0], float):
            out.append((f"{LABELS.get(layer, layer)}: 4096 tokens >= {GOALS['prefill_4096']}x bf16",
                        f"{big[0]:.2f}x", big[0] >= GOALS["prefill_4096"]))
    return out


def markdown(res: dict) -> str:
    head = ["layer", "tokens", "active experts", "bf16 (us)", "bf16 impl", "W4A16 (us)", "x bf16", "W4A4 (us)",
            "x bf16", "W4A4 4/6 (us)", "x bf16", "rel. error w13 W4A16 / W4A4 / 4/6", "layer", "W4A16 path w13 / w2"]
    cells = []
    for r in res["rows"]:
        errs = " / ".join(f"{r.get(f'{s}_w13_rel_err', float('nan')):.1e}" for s in SCHEMES)
        layer_errs = " / ".join(f"{r.get(f'{s}_rel_err', float('nan')):.1e}" for s in SCHEMES)
        cells.append([LABELS.get(r["layer"], r["layer"]), r["tokens"], f"{r['active_experts']}/{r['experts']}",
                      _us(r.get("bf16_us")), r.get("bf16_impl", ""), _us(r.get("w4a16_us")), _x(r.get("w4a16_x_bf16")),
                      _us(r.get("w4a4_us")), _x(r.get("w4a4_x_bf16")), _us(r.get("w4a4_46_us")),
                      _x(r.get("w4a4_46_x_bf16")), errs, layer_errs,
                      f"{r.get('w4a16_w13_path', '-')} / {r.get('w4a16_w2_path', '-')}"])
    env = res.get("env", {})
    title = (f"MoE experts, NVFP4 grouped kernel vs bf16 ({env.get('gpu', '?')}, torch {env.get('torch', '?')}, "
             f"triton {env.get('triton', '?')}; CUDA-graph replays, median of {res.get('rounds', '?')} rounds)")
    lines = [title, ""]
    lines += harness.md_table(head, cells)
    glue = [r for r in res["rows"] if "route_us" in r]
    if glue:  # the routing and the combine alone: the kernels both layers use, the torch ops they replace
        lines += ["", "| layer | tokens | route kernels (us) | route torch (us) | combine kernel (us) | combine torch (us) "
                  "| equal to torch (route / combine) |", "|---|---|---|---|---|---|---|"]
        lines += [f"| {LABELS.get(r['layer'], r['layer'])} | {r['tokens']} | {_us(r.get('route_us'))} | "
                  f"{_us(r.get('route_torch_us'))} | {_us(r.get('combine_us'))} | {_us(r.get('combine_torch_us'))} | "
                  f"{r.get('route_equal')} / {r.get('combine_equal')} |" for r in glue]
    goals = verdicts(res)
    if goals:
        lines += ["", "| goal (issue 44) | measured | met |", "|---|---|---|"]
        lines += [f"| {g} | {f} | {'met' if m else 'not met'} |" for g, f, m in goals]
    return "\n".join(lines) + "\n"


def plot(res: dict, path: str) -> None:
    """x bf16 against tokens, one line per layer and scheme (log-x), the goals as dashed lines."""
    plt = harness.pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for layer in dict.fromkeys(r["layer"] for r in res["rows"]):
        rows = sorted((r for r in res["rows"] if r["layer"] == layer), key=lambda r: r["tokens"])
        for scheme, style in zip(SCHEMES, ("-o", "--s", ":^")):
            pts = [(r["tokens"], r[f"{scheme}_x_bf16"]) for r in rows if isinstance(r.get(f"{scheme}_x_bf16"), float)]
            if pts:
                ax.plot(*zip(*pts), style, label=f"{LABELS.get(layer, layer)} {scheme}")
    ax.axhline(GOALS["decode"], color="grey", ls="--", lw=0.8)
    ax.axhline(GOALS["prefill_4096"], color="grey", ls=":", lw=0.8)
    ax.axhline(1.0, color="black", lw=0.5)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens")
    ax.set_ylabel("speed vs bf16 (x)")
    ax.set_title("NVFP4 grouped MoE experts vs bf16")
    ax.legend(fontsize=7)
    fig.tight_layout()
    folder = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(folder, ".tmp-" + os.path.basename(path))
    fig.savefig(tmp, dpi=120, format="png")
    plt.close(fig)
    os.replace(tmp, path)


def write_reports(res: dict, json_path: str) -> tuple:
    """The markdown table and the figure beside ``json_path`` (``NAME.md``, ``NAME.png``)."""
    stem = str(Path(json_path).with_suffix(""))
    harness.write_text(stem + ".md", markdown(res))
    plot(res, stem + ".png")
    return stem + ".md", stem + ".png"


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", default=",".join(LAYERS), help=f"comma-separated, of {', '.join(LAYERS)}")
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="comma-separated token counts")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds (median)")
    ap.add_argument("--name", default="moe_h200", help="results file name under $OUT (no suffix)")
    ap.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # (a dry run of the script's glue)
    ap.add_argument("--sweep", action="store_true", help="the time split and the tile sweep instead (W4A16)")
    ap.add_argument("--budget", type=float, default=300, help="--sweep: stop starting new rows after this many s")
    ap.add_argument("--splits", default=",".join(map(str, SPLITS)), help="--sweep: K splits timed at decode")
    ap.add_argument("--report", metavar="JSON", help="only write NAME.md and NAME.png beside this results file")
    args = ap.parse_args(argv)
    args.layers = [a for a in args.layers.split(",") if a]
    unknown = [a for a in args.layers if a not in LAYERS]
    if unknown:
        ap.error(f"unknown layer(s) {', '.join(unknown)}; choose from {', '.join(LAYERS)}")
    args.tokens = _positive_ints(ap, "--tokens", args.tokens)
    args.splits = _positive_ints(ap, "--splits", args.splits)
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")
    return args


def _positive_ints(ap, flag: str, text: str) -> list:
    """The comma-separated integers >= 1 of ``flag``'s value (one or more), else a usage error (exit 2)."""
    try:
        values = [int(t) for t in text.split(",") if t]
    except ValueError:
        ap.error(f"{flag}: expected comma-separated integers, got {text!r}")
    if not values or min(values) < 1:
        ap.error(f"{flag}: give one or more integers >= 1")
    return values


def main(argv=None) -> int:
    args = parse(argv)
    if args.report:
        md, png = write_reports(harness.read_results(args.report, "bench_moe_h200"), args.report)
        print(Path(md).read_text(), end="")
        print(f"wrote {md} and {png}")
        return 0
    sweep(args) if args.sweep else run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
