"""Quantizing with 2 and 4 processes (torch.distributed, gloo on CPU), as torchrun runs
``fp4ptq quantize``: the checkpoint equals the single-process one byte for byte
for RTN, GPTQ and AWQ in W4A16 and W4A4, SmoothQuant, and rotation with a keep
budget, on a tiny Llama (through the CLI) and a tiny Qwen3-MoE (through the
Python API, experts calibrated on their routed tokens or on all); only rank 0
draws progress bars; a rank that raises, is killed or stops answering ends every
rank with exit code 1 and leaves no checkpoint.

The ranks are forked from one forkserver (torch and transformers imported
once), run ``fp4ptq.cli.main`` in-process and reuse themselves across the
cases. Every process uses one thread: CPU GEMMs are reproducible at equal
thread counts."""
from __future__ import annotations

import json
import multiprocessing
import os
import signal
import socket
import sys
import time
from pathlib import Path

import pytest
import torch

from fp4ptq import cli, distributed, pipeline, stats
from test_eval_perplexity import build_model, build_tokenizer, write_data_dir

# One sequence per batch: 4 batches, 2 per rank (the float64 sums regroup).
TOKENS_PER_CALL = 16
CASES = [(method, scheme) for method in ("rtn", "gptq", "awq") for scheme in ("w4a16", "w4a4")]
# One more Llama case through the CLI, without -q: SmoothQuant after a rotation, with a part
# kept in bf16 by measurement; its progress bars (the weights' loading, the keep budget's
# sensitivity, the blocks) must come from rank 0 alone.
LOUD_CASE = ("smoothquant-w4a4-rot16-keep1", "smoothquant", "w4a4", ("--rotate", "16", "--keep-budget", "1"), False)
# The MoE cases: (method, scheme, moe_calib). Under "routed" an expert's routed tokens differ
# in number per batch: its search samples become one row of tokens (moe._token_rows).
MOE_CASES = [(m, s, "all" if m == "awq" else "routed") for m, s in CASES] + [("gptq", "w4a4", "all"),
                                                                            ("awq", "w4a4", "routed")]


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    tok = build_tokenizer(root / "src")
    build_model(len(tok)).save_pretrained(root / "src")
    write_data_dir(root / "data")
    (root / "calib.txt").write_text((root / "data" / "wikitext2" / "wiki.test.raw").read_text() * 3)
    _tiny_moe(len(tok)).save_pretrained(root / "moe")
    return root


def _tiny_moe(vocab: int):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model("qwen3_moe", hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                  num_experts=4, num_experts_per_tok=2, vocab_size=vocab, max_position_embeddings=64)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 3 or name.endswith("gate.weight"):
                p.normal_(0, 0.1)   # transformers initialises expert tensors and routers to zero
    return model


def _quantize_moe(work: Path, method: str, scheme: str, moe_calib: str, out: Path, nsamples: int = 4) -> int:
    """The Python API under a process group, when there is one: every rank quantizes, rank 0 saves."""
    import fp4ptq
    from transformers import AutoModelForCausalLM

    with distributed.launch("cpu") as (world, device):
        with cli._quiet_libraries(True):   # no loading bar on any rank: the CLI cases test rank 0's bars
            model = AutoModelForCausalLM.from_pretrained(work / "moe").eval()
        config = fp4ptq.QuantConfig(method=method, scheme=scheme, moe_calib=moe_calib, search_nsamples=3, awq_grid=4,
                                    four_six="mse" if scheme == "w4a4" else None, awq_clip=method == "awq")
        calib = torch.randint(4, model.config.vocab_size, (nsamples, 16), generator=torch.Generator().manual_seed(1))
        fp4ptq.quantize(model, config, calib, device=device, progress=False)
        if world.parallel:   # every rank's peak and share, kept out of the written report
            ranks = model.fp4ptq_info["peak_memory"]["ranks"]
            assert [r["rank"] for r in ranks] == list(range(world.size)) and all(r["host_rss_bytes"] > 0 for r in ranks)
            share = 0 if (method, scheme) == ("rtn", "w4a16") else nsamples // world.size
            assert [r["sequences"] for r in ranks] == [share] * world.size
        if world.main:
            fp4ptq.save(model, out)
    return 0


def _argv(work: Path, method: str, scheme: str, out: Path, extra=(), nsamples: int = 4, quiet: bool = True) -> list:
    argv = ["quantize", str(work / "src"), "--method", method, "--scheme", scheme, "--calib", str(work / "calib.txt"),
            "--nsamples", str(nsamples), "--seqlen", "16", "--search-nsamples", "3", "--awq-grid", "4",
            "--output", str(out), "--device", "cpu", *extra] + (["-q"] if quiet else [])
    if scheme == "w4a4":
        argv += ["--four-six", "mse"]
    if method == "awq":
        argv += ["--awq-clip"]
    return argv


def _free_ports(n: int) -> list:
    ports, socks = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


def _rank_main(rank: int, size: int, jobs: list, log: str, inject: tuple) -> None:
    """One rank: run each ``(argv, port)`` job through the CLI, record the exit codes;
    ``inject = (rank, "raise" | "kill" | "stop")`` fails that rank in block 1's rounding."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    torch.set_num_threads(1)
    stats.TOKENS_PER_CALL = TOKENS_PER_CALL
    distributed.HEARTBEAT_S, distributed.DEAD_AFTER_S = 0.2, 2.0
    distributed.GATHER_BYTES = 4096   # the 64 x 64 Hessians are gathered in 16 pieces
    if inject and inject[0] == rank:
        install = pipeline.install_group

        def failing(*args):   # install_group(block, group, members, stats, config, prefix, rounded)
            if args[5].endswith("layers.1"):
                if inject[1] == "raise":
                    raise RuntimeError("injected failure")
                os.kill(os.getpid(), signal.SIGKILL if inject[1] == "kill" else signal.SIGSTOP)
            return install(*args)

        pipeline.install_group = failing
    codes = []
    for argv, port in jobs:
        os.environ.update(WORLD_SIZE=str(size), RANK=str(rank), LOCAL_RANK=str(rank),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        codes.append(cli.main(argv) if isinstance(argv, list) else _quantize_moe(*argv))
    Path(log + ".codes").write_text(json.dumps(codes))
    sys.stdout.flush()
    os._exit(next((c for c in codes if c), 0))


def _launch(tmp: Path, jobs: list, inject: tuple = (), size: int = 2, timeout: float = 120):
    """Run the ranks; ``(exit codes of the processes, CLI codes per rank or None, logs)``."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "transformers", "transformers.models.llama.modeling_llama", "accelerate.utils",
                                "fp4ptq.cli", "fp4ptq.calib", "fp4ptq.checkpoint", "fp4ptq.sources", "test_distributed"])
    logs = [str(tmp / f"rank{r}.log") for r in range(size)]
    procs = [ctx.Process(target=_rank_main, args=(r, size, jobs, logs[r], inject)) for r in range(size)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for r, p in enumerate(procs):
        p.join(max(1.0, deadline - time.monotonic()))
        if inject and inject[1] == "stop" and r != inject[0]:
            os.kill(procs[inject[0]].pid, signal.SIGKILL)   # the stopped rank never ends by itself
    for p in procs:
        if p.exitcode is None:
            p.kill()
            p.join()
    codes = [json.loads(Path(f + ".codes").read_text()) if Path(f + ".codes").exists() else None for f in logs]
    return [p.exitcode for p in procs], codes, [Path(f).read_text(errors="replace") for f in logs]


def _same_checkpoint(a: Path, b: Path) -> None:
    """Every file byte for byte (the written report holds no run times or peaks)."""
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def _jobs(work: Path, root: Path, cli_cases: list, moe_cases: list, nsamples: int = 4) -> dict:
    """``{name: job}`` writing ``root / name``: CLI argument lists (``cli.main``) for
    ``(name, method, scheme, extra, quiet)`` and ``_quantize_moe`` arguments for the MoE cases."""
    root.mkdir()
    jobs = {name: _argv(work, m, s, root / name, extra, nsamples, quiet) for name, m, s, extra, quiet in cli_cases}
    jobs.update({"moe-" + "-".join(case): (work, *case, root / ("moe-" + "-".join(case)), nsamples)
                 for case in moe_cases})
    return jobs


def _one_process(jobs, monkeypatch) -> None:
    """Run ``jobs`` in this process (no torchrun environment) with one thread, as the ranks do."""
    monkeypatch.setattr(stats, "TOKENS_PER_CALL", TOKENS_PER_CALL)
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for job in jobs:
            assert (cli.main(job) if isinstance(job, list) else _quantize_moe(*job)) == 0, job
    finally:
        torch.set_num_threads(threads)


def _draws_bars(log: str) -> bool:
    """tqdm's output: a bar's "NN%|" or its rate."""
    return any(mark in log for mark in ("%|", "it/s]", "s/it]"))


def _ranks_match_one_process(work: Path, tmp_path: Path, monkeypatch, size: int, cli_cases: list, moe_cases: list,
                             nsamples: int) -> list:
    """Every case in one process and on ``size`` ranks: the same checkpoints byte for byte; the ranks' logs."""
    one = _jobs(work, tmp_path / "one", cli_cases, moe_cases, nsamples)
    many = _jobs(work, tmp_path / "many", cli_cases, moe_cases, nsamples)
    _one_process(one.values(), monkeypatch)
    exits, codes, logs = _launch(tmp_path, list(zip(many.values(), _free_ports(len(many)))), size=size,
                                 timeout=60 * size)
    assert exits == [0] * size and codes == [[0] * len(many)] * size, logs
    for name in one:
        _same_checkpoint(tmp_path / "one" / name, tmp_path / "many" / name)
    # Rank 0 alone speaks: no message and no progress bar from the others.
    assert "fp4ptq: quantizing" in logs[0] and not any("fp4ptq:" in log or _draws_bars(log) for log in logs[1:]), logs
    assert logs[0].count(f"on {size} ranks, rank 0's, peak ") == len(cli_cases) == logs[0].count("; peak per rank: ")
    return logs


def test_two_ranks_write_the_single_process_checkpoint(work, tmp_path, monkeypatch):
    cli_cases = [(f"{m}-{s}", m, s, (), True) for m, s in CASES] + [LOUD_CASE]
    logs = _ranks_match_one_process(work, tmp_path, monkeypatch, 2, cli_cases, MOE_CASES, 4)
    info = json.loads((tmp_path / "many" / "moe-gptq-w4a4-routed" / "fp4ptq_report.json").read_text())
    assert sum(".experts." in n for n in info["layers"]) == 2 * 4 * 3   # 2 blocks x 4 experts x gate/up/down
    info = json.loads((tmp_path / "many" / LOUD_CASE[0] / "fp4ptq_report.json").read_text())
    assert info["config"]["rotate"] == 16 and any("keep_budget" in r for r in info["high_precision"].values())
    assert info["smoothing"]
    # The run without -q: rank 0 draws its bars (the weights' loading, the keep budget's measurement,
    # the blocks), rank 1 none (above).
    assert "fp4ptq sensitivity" in logs[0] and _draws_bars(logs[0]), logs[0]
    assert "fp4ptq: note: --calib" in logs[0]   # said before the process group exists, by rank 0 too


def test_four_ranks_write_the_single_process_checkpoint(work, tmp_path, monkeypatch):
    # 8 sequences, one a batch: 2 batches per rank, so the float64 sums regroup
    # ((b0+b1)+(b2+b3)+... against one process's b0+b1+...+b7).
    cli_cases = [("gptq-w4a16", "gptq", "w4a16", (), True), ("awq-w4a4", "awq", "w4a4", (), True)]
    _ranks_match_one_process(work, tmp_path, monkeypatch, 4, cli_cases, [("gptq", "w4a4", "routed")], 8)


@pytest.mark.parametrize("failing, fault", [(1, "raise"), (0, "kill"), (1, "kill"), (1, "stop")])
def test_a_failing_rank_ends_every_rank_with_exit_code_1_and_no_checkpoint(work, tmp_path, failing, fault):
    # raise: rank 1's error is recorded for rank 0's watchdog; kill rank 0 (the
    # store's host): rank 1 loses its collective and its store; kill rank 1: rank 0
    # loses its collective; stop: rank 1 hangs without dying (as a dead NCCL peer
    # looks), found by its silent heartbeat.
    out = tmp_path / "ckpt"
    (port,) = _free_ports(1)
    exits, codes, logs = _launch(tmp_path, [(_argv(work, "gptq", "w4a4", out), port)], inject=(failing, fault))
    survivor = 1 - failing
    assert exits[survivor] == 1, logs
    assert exits[failing] == (1 if fault == "raise" else -signal.SIGKILL), logs
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".ckpt")]
    if fault == "raise":
        assert "rank 1 failed: RuntimeError: injected failure" in logs[0], logs
    elif fault == "stop":
        assert "rank 1 has not answered" in logs[0], logs
    elif failing == 1:
        assert "lost contact with another rank" in logs[0], logs


def test_assignment_is_balanced_by_cost_and_deterministic():
    costs = [10.0, 1.0, 7.0, 3.0, 3.0, 6.0]
    owners = distributed.assign(costs, 2)
    assert owners == distributed.assign(costs, 2)
    loads = [sum(c for c, o in zip(costs, owners) if o == r) for r in range(2)]
    assert loads == [16.0, 14.0]   # longest first: within 4/3 of the best split (15, 15)
    assert distributed.assign([1.0, 1.0, 1.0], 4) == [0, 1, 2]
    assert distributed.assign(costs, 1) == [0] * len(costs)


def test_shards_are_whole_batches_counted_from_the_first_sequence():
    for size in (1, 2, 3, 4, 8):
        w = distributed.World(size=size, rank=0)
        bounds = [distributed.shard(10, 4, w, r) for r in range(size)]
        assert bounds[0][0] == 0 and bounds[-1][1] == 10
        assert all(a == b for (_, a), (b, _) in zip(bounds, bounds[1:]))
        assert all(a % 4 == 0 for a, _ in bounds)


def test_float64_regrouping_moves_float32_sums_by_at_most_one_ulp():
    # The stated bound: fp32 per-batch sums added in float64 in any grouping
    # (one rank: b0+b1+b2+b3; two: (b0+b1)+(b2+b3)) round to float32 values at
    # most one ulp apart, and equal except near a rounding boundary.
    g = torch.Generator().manual_seed(0)
    batches = [torch.randn(4096, generator=g) * 10 ** torch.randint(-3, 4, (4096,), generator=g) for _ in range(8)]
    one = torch.zeros(4096, dtype=torch.float64)
    for b in batches:
        one += b
    halves = [torch.zeros(4096, dtype=torch.float64) for _ in range(2)]
    for i, b in enumerate(batches):
        halves[i // 4] += b
    a, b = one.float(), (halves[0] + halves[1]).float()
    ulp = torch.nextafter(a.abs(), torch.tensor(float("inf"))) - a.abs()
    assert bool(((a - b).abs() <= ulp).all())
    assert float((a != b).float().mean()) < 1e-3


def test_bad_torchrun_environment_is_a_usage_error(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "two")
    with pytest.raises(distributed.DistributedError, match="RANK='two'"):
        distributed.env_world()
    monkeypatch.setenv("RANK", "2")
    with pytest.raises(distributed.DistributedError, match="0 <= RANK < WORLD_SIZE"):
        distributed.env_world()
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.delenv("RANK")
    assert distributed.env_world() == distributed.SINGLE and distributed.world() == distributed.SINGLE


def test_each_rank_uses_its_local_rank_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert distributed.rank_device("cuda", distributed.World(4, 1, 1)) == "cuda:1"
    assert distributed.rank_device("cuda", distributed.World(4, 2, 0)) == "cuda:0"   # 2nd node's first rank
    assert distributed.rank_device("cpu", distributed.World(4, 3, 1)) == "cpu"
    assert distributed.rank_device("cuda:1", distributed.SINGLE) == "cuda:1"   # one process: as given
    with pytest.raises(distributed.DistributedError, match="--device cuda:1: under torchrun every rank uses its "
                                                           "LOCAL_RANK GPU; give --device cuda"):
        distributed.rank_device("cuda:1", distributed.World(2, 0, 0))
    with pytest.raises(distributed.DistributedError, match="rank 3: LOCAL_RANK=3 but this node has 2 GPU"):
        distributed.rank_device("cuda", distributed.World(4, 3, 3))


def test_routed_experts_go_to_the_runs_by_decreasing_cost(work):
    # Under "routed" a run of experts (one per rank) lasts as long as its slowest solve:
    # the runs take the experts by decreasing cost. Expert 1 gets 8 tokens, 2 gets 5, 3 gets 3,
    # 0 none (RTN: the cheapest); AWQ's down search costs in proportion to the tokens.
    import fp4ptq
    from fp4ptq import moe
    from fp4ptq.experts import LinearExperts, linearize_model
    from transformers import AutoModelForCausalLM

    with cli._quiet_libraries(True):
        model = AutoModelForCausalLM.from_pretrained(work / "moe")
    linearize_model(model)
    module = next(m for m in model.modules() if isinstance(m, LinearExperts))
    captured = [(torch.zeros(8, 64), torch.tensor([[2, 1]] * 5 + [[1, 3]] * 3), None)]
    for method in ("awq", "gptq"):
        config = fp4ptq.QuantConfig(method=method, moe_calib="routed", search_nsamples=3)
        assert moe._routed_order(module, captured, [0], 3, config, distributed.SINGLE) == [1, 2, 3, 0], method
    captured[0][1][:5] = torch.tensor([3, 1])   # 1 and 3 get 8 tokens each, 0 and 2 none: ties by index
    assert moe._routed_order(module, captured, [0], 3, config, distributed.SINGLE) == [1, 3, 0, 2]
