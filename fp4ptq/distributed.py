"""Quantizing with several processes through torch.distributed (``torchrun ... -m fp4ptq quantize``).

Everything that talks to other processes lives here; the pipeline calls it at a
few named points and runs unchanged in one process (world size 1, no process
group, every function below a no-op or a local step).

- World: ``WORLD_SIZE`` / ``RANK`` / ``LOCAL_RANK`` from the environment
  (torchrun, Slurm via torchrun, Kubernetes); NCCL for CUDA, gloo for CPU;
  each rank uses its ``LOCAL_RANK`` GPU.
- Data parallel calibration: the calibration sequences are cut into the
  pipeline's batches (``unit`` sequences each, counted from the first
  sequence, whatever the world size) and each rank gets a contiguous run of
  whole batches, so every sequence is computed in the same batch, hence to the
  same bits, for any number of ranks.
- Statistics: max |x| reduced by max (exact); sums (|x|, the GPTQ Hessian) are
  accumulated in float64 per rank and added in rank order, then rounded to
  float32 once. The float64 grouping differs between world sizes, by at most a
  few float64 ulps, which moves the float32 result only when it lies within
  that distance of a rounding boundary (``sum_in_rank_order``'s test states
  the bound: at most one float32 ulp). Search samples are the first sequences
  of the whole run, sent by the rank that holds each.
- Solves: a block's work comes as ``SolveUnit``s (a name, a cost, a function
  returning tensors); ``assign`` balances them over the ranks by cost
  (longest first, deterministic), each rank runs its own and the results are
  broadcast byte for byte from their owner.
- Failures: a rank that raises records its error in the rendezvous store; a
  watchdog thread on every rank stops its process (exit code 1, naming the
  failed rank) when it sees one, when a peer's heartbeat stops (a killed
  rank), or when the store itself is gone. Rank 0 writes the checkpoint after
  every rank finished; nothing is written on failure.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence

import torch

# A collective waits this long for its peers (rank 0 writing a large checkpoint
# while the others wait is the longest legitimate wait). Dead peers are found
# sooner by the heartbeat below.
COLLECTIVE_TIMEOUT = datetime.timedelta(hours=2)
# Every rank bumps its heartbeat this often (seconds) and checks the others';
# a peer silent for DEAD_AFTER_S is taken for dead (killed, or its node lost).
HEARTBEAT_S = 1.0
DEAD_AFTER_S = 60.0
# Statistics are gathered in pieces of at most this many bytes (all ranks' parts together).
GATHER_BYTES = 256 * 2**20
# How long a failing rank waits for its peers to read its error before exiting.
ACK_WAIT_S = 5.0


class DistributedError(RuntimeError):
    """The torchrun environment or the device given for it is unusable."""


class PeerFailed(DistributedError):
    """Another rank failed first; this rank's error was its consequence."""


@dataclass(frozen=True)
class World:
    """This process's place: ``size`` ranks, this is ``rank`` (``local_rank`` on its node)."""

    size: int = 1
    rank: int = 0
    local_rank: int = 0
    backend: Optional[str] = None   # "nccl" / "gloo" with a process group, None without

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def parallel(self) -> bool:
        return self.size > 1


SINGLE = World()


def _env_int(name: str, default: int) -> int:
    text = os.environ.get(name)
    if text is None or text == "":
        return default
    try:
        return int(text)
    except ValueError:
        raise DistributedError(f"environment variable {name}={text!r} is not an integer (set by torchrun)") from None


def env_world() -> World:
    """The world torchrun (or an equivalent launcher) describes in the environment."""
    size = _env_int("WORLD_SIZE", 1)
    rank = _env_int("RANK", 0)
    local_rank = _env_int("LOCAL_RANK", rank)
    if size < 1 or not 0 <= rank < size or local_rank < 0:
        raise DistributedError(f"WORLD_SIZE={size}, RANK={rank}, LOCAL_RANK={local_rank}: need "
                               "WORLD_SIZE >= 1 and 0 <= RANK < WORLD_SIZE (launch with torchrun)")
    return World(size, rank, local_rank)


def world() -> World:
    """The world of the current process group (``SINGLE`` when there is none)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return SINGLE
    return World(dist.get_world_size(), dist.get_rank(), _env_int("LOCAL_RANK", dist.get_rank()),
                 str(dist.get_backend()))


def rank_device(device: str, w: World) -> str:
    """``device`` for this rank: CUDA ranks use their ``LOCAL_RANK`` GPU."""
    if w.parallel and device.startswith("cuda"):
        if ":" in device:
            raise DistributedError(f"--device {device}: under torchrun every rank uses its LOCAL_RANK GPU; "
                                   "give --device cuda (limit the GPUs with CUDA_VISIBLE_DEVICES)")
        if w.local_rank >= torch.cuda.device_count():
            raise DistributedError(f"rank {w.rank}: LOCAL_RANK={w.local_rank} but this node has "
                                   f"{torch.cuda.device_count()} GPU(s); start at most that many processes per node")
        return f"cuda:{w.local_rank}"
    return device


# --------------------------------------------------------------------------- #
# The process group and its watchdog
# --------------------------------------------------------------------------- #
class _Watchdog(threading.Thread):
    """Heartbeats through the rendezvous store; ends the process (exit code 1)
    when a peer recorded an error, stopped beating, or the store is gone."""

    def __init__(self, store, w: World, dead_after: float) -> None:
        super().__init__(name="fp4ptq-watchdog", daemon=True)
        self.store, self.world, self.dead_after = store, w, dead_after
        self.stopping = threading.Event()
        self.lock = threading.Lock()   # the store is shared with the main thread's failure report

    def run(self) -> None:
        peers = [r for r in range(self.world.size) if r != self.world.rank]
        seen = {r: (-1, time.monotonic()) for r in peers}
        while not self.stopping.wait(HEARTBEAT_S):
            try:
                with self.lock:
                    self.store.add(f"beat/{self.world.rank}", 1)
                    failed = self.store.check(["error"])
                    error = self.store.get("error").decode() if failed else None
                    beats = {r: self.store.add(f"beat/{r}", 0) for r in peers}
                    done = {r for r in peers if self.store.check([f"done/{r}"])}
            except Exception as exc:  # noqa: BLE001 - any store failure means the run is lost
                if not self.stopping.is_set():
                    self._stop_process(f"lost the rendezvous store ({type(exc).__name__}: {exc}); "
                                       "the rank or launcher that held it is gone")
                return
            if self.stopping.is_set():
                return
            if error is not None:
                with contextlib.suppress(Exception), self.lock:
                    self.store.add("acks", 1)
                self._stop_process(f"stopping: {error}")
            now = time.monotonic()
            for r in peers:
                if beats[r] != seen[r][0]:
                    seen[r] = (beats[r], now)
                elif r not in done and now - seen[r][1] > self.dead_after:
                    self._stop_process(f"stopping: rank {r} has not answered for {now - seen[r][1]:.0f} s "
                                       "(killed, or its node lost)")

    def _stop_process(self, message: str) -> None:
        print(f"fp4ptq: rank {self.world.rank}: {message}", file=sys.stderr, flush=True)
        os._exit(1)


@contextlib.contextmanager
def launch(device: str) -> Iterator[tuple[World, str]]:
    """Join the process group the environment describes (none for one process)
    and yield ``(world, device)`` with this rank's device.

    On leaving normally every rank waits for the others (rank 0 may still be
    writing), then the group is destroyed. On an error the rank records it for
    its peers, whose watchdogs stop them with exit code 1, and re-raises it."""
    w = env_world()
    if not w.parallel:
        yield SINGLE, device
        return
    import torch.distributed as dist

    device = rank_device(device, w)
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(torch.device(device))
    store, _, _ = next(dist.rendezvous("env://", rank=w.rank, world_size=w.size, timeout=COLLECTIVE_TIMEOUT))
    dist.init_process_group(backend, store=store, rank=w.rank, world_size=w.size, timeout=COLLECTIVE_TIMEOUT,
                            device_id=torch.device(device) if backend == "nccl" else None)
    ours = dist.PrefixStore("fp4ptq/", store)
    watchdog = _Watchdog(ours, World(w.size, w.rank, w.local_rank, backend), DEAD_AFTER_S)
    watchdog.start()
    try:
        yield World(w.size, w.rank, w.local_rank, backend), device
    except BaseException as exc:
        first = _report_failure(ours, watchdog, w, exc)
        if _is_communication_error(exc):   # the consequence of a peer's failure or death
            raise PeerFailed(first or f"lost contact with another rank (killed, or its node lost): "
                                      f"{str(exc).splitlines()[0][:300]}") from exc
        raise
    dist.barrier()                   # every rank done (rank 0 has written)
    with watchdog.lock:
        ours.set(f"done/{w.rank}", "1")
    watchdog.stopping.set()
    watchdog.join()
    dist.barrier()                   # no watchdog is still reading the store
    dist.destroy_process_group()


def _is_communication_error(exc: BaseException) -> bool:
    """A collective or the store failed (e.g. a peer went away mid-collective)."""
    import torch.distributed as dist

    return isinstance(exc, dist.DistError) or (
        type(exc) is RuntimeError and any(word in str(exc) for word in ("gloo", "Gloo", "NCCL", "onnection")))


def _report_failure(store, watchdog: _Watchdog, w: World, exc: BaseException) -> Optional[str]:
    """Record ``exc`` as the run's error for the peers' watchdogs and wait
    briefly for them to read it. Returns the error a peer recorded first, if
    one did (this rank's error is then its consequence), else None."""
    message = f"rank {w.rank} failed: {type(exc).__name__}: {exc}".splitlines()[0]
    watchdog.stopping.set()
    try:
        with watchdog.lock:
            first = store.compare_set("error", "", message).decode()
        if first != message:
            return first
        if _is_communication_error(exc):   # a peer is gone: it will not answer
            return None
        deadline = time.monotonic() + ACK_WAIT_S
        while time.monotonic() < deadline:   # before this rank's exit may take the store with it
            with watchdog.lock:
                if store.add("acks", 0) >= w.size - 1:
                    break
            time.sleep(0.05)
    except Exception:  # noqa: BLE001 - the store is gone: the peers find out through their watchdogs
        pass
    return None


# --------------------------------------------------------------------------- #
# Sharding, statistics
# --------------------------------------------------------------------------- #
def shard(n: int, unit: int, w: World, rank: Optional[int] = None) -> tuple[int, int]:
    """Items ``[start, stop)`` of ``n`` for ``rank`` (default: this one): whole
    runs of ``unit`` items counted from item 0, spread evenly over the ranks."""
    rank = w.rank if rank is None else rank
    chunks = -(-n // max(unit, 1))
    return min(n, chunks * rank // w.size * unit), min(n, chunks * (rank + 1) // w.size * unit)


def sum_in_rank_order(partial: torch.Tensor, w: World, *, dst: Optional[int] = None) -> Optional[torch.Tensor]:
    """The float64 sum of every rank's ``partial``, added in rank order, as
    float32: on every rank (``dst`` None) or on ``dst`` only (others get None).
    Gathered in pieces of at most GATHER_BYTES over all ranks (a 28672^2
    float64 Hessian is 6.6 GB), through the group's own collectives."""
    import torch.distributed as dist

    partial = partial.double()
    if not w.parallel:
        return partial.float()
    flat = partial.reshape(-1)
    receives = dst is None or w.rank == dst
    out = torch.empty(flat.numel(), dtype=torch.float32, device=flat.device) if receives else None
    step = max(1, GATHER_BYTES // (flat.element_size() * w.size))
    for start in range(0, flat.numel(), step):
        piece = flat[start : start + step].contiguous()
        parts = [torch.empty_like(piece) for _ in range(w.size)] if receives else None
        if dst is None:
            dist.all_gather(parts, piece)
        else:
            dist.gather(piece, parts, dst=dst)
        if receives:
            total = parts[0].clone()
            for part in parts[1:]:
                total.add_(part)
            out[start : start + step] = total.float()
    return out.reshape(partial.shape) if receives else None


def max_over_ranks(x: torch.Tensor, w: World) -> torch.Tensor:
    import torch.distributed as dist

    if w.parallel:
        x = x.clone()
        dist.all_reduce(x, op=dist.ReduceOp.MAX)
    return x


def sum_int(n: int, w: World, device) -> int:
    import torch.distributed as dist

    if not w.parallel:
        return n
    t = torch.tensor([n], dtype=torch.int64, device=device)
    dist.all_reduce(t)
    return int(t.item())


# --------------------------------------------------------------------------- #
# Moving results: any nest of tensors, dataclasses, lists, tuples, dicts, plain values
# --------------------------------------------------------------------------- #
@dataclass(frozen=True)
class _TensorSlot:
    index: int
    shape: tuple
    dtype: torch.dtype


def _strip(obj, tensors: list):
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return _TensorSlot(len(tensors) - 1, tuple(obj.shape), obj.dtype)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return (type(obj), {f.name: _strip(getattr(obj, f.name), tensors) for f in dataclasses.fields(obj)})
    if isinstance(obj, (list, tuple)):
        return type(obj)(_strip(o, tensors) for o in obj)
    if isinstance(obj, dict):
        return {k: _strip(v, tensors) for k, v in obj.items()}
    return obj


def _fill(skeleton, tensors: list):
    if isinstance(skeleton, _TensorSlot):
        return tensors[skeleton.index]
    if isinstance(skeleton, tuple) and len(skeleton) == 2 and isinstance(skeleton[0], type) \
            and dataclasses.is_dataclass(skeleton[0]):
        cls, fields = skeleton
        return cls(**{k: _fill(v, tensors) for k, v in fields.items()})
    if isinstance(skeleton, (list, tuple)):
        return type(skeleton)(_fill(o, tensors) for o in skeleton)
    if isinstance(skeleton, dict):
        return {k: _fill(v, tensors) for k, v in skeleton.items()}
    return skeleton


def _bytes_view(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8,
                                                                                     device=t.device)


def broadcast(obj: Any, src: int, w: World, device) -> Any:
    """``obj`` from rank ``src`` on every rank (``obj`` is ignored elsewhere):
    its structure by pickle, its tensors as raw bytes (exact for any dtype,
    float8 included), placed on ``device``."""
    import torch.distributed as dist

    if not w.parallel:
        return obj
    tensors: list = []
    box = [_strip(obj, tensors) if w.rank == src else None]
    dist.broadcast_object_list(box, src=src, device=torch.device(device) if w.backend == "nccl" else None)
    skeleton = box[0]
    slots = []
    _collect_slots(skeleton, slots)
    out = []
    for slot in sorted(slots, key=lambda s: s.index):
        if w.rank == src:
            data = _bytes_view(tensors[slot.index].to(device))
        else:
            nbytes = int(torch.Size(slot.shape).numel()) * torch.empty(0, dtype=slot.dtype).element_size()
            data = torch.empty(nbytes, dtype=torch.uint8, device=device)
        if data.numel():
            dist.broadcast(data, src=src)
        out.append(tensors[slot.index].to(device) if w.rank == src
                   else data.view(slot.dtype).reshape(slot.shape) if data.numel()
                   else torch.empty(slot.shape, dtype=slot.dtype, device=device))
    return _fill(skeleton, out)


def _collect_slots(skeleton, slots: list) -> None:
    if isinstance(skeleton, _TensorSlot):
        slots.append(skeleton)
    elif isinstance(skeleton, dict):
        for v in skeleton.values():
            _collect_slots(v, slots)
    elif isinstance(skeleton, (list, tuple)):
        for v in skeleton:
            _collect_slots(v, slots)


def gather_first(keys: Sequence[int], items: list, count: int, w: World, device) -> list:
    """The ``count`` items of smallest key over all ranks, in key order, on every
    rank; ``keys[i]`` is this rank's ``items[i]``'s place in the whole run (e.g. a
    sequence's or a batch's index), each key held by one rank."""
    if not w.parallel:
        return [item for _, item in sorted(zip(keys, items), key=lambda p: p[0])][:count]
    everyone = gather_report(list(keys)[: len(items)], w)
    owned = sorted((k, r) for r, ks in enumerate(everyone) for k in ks)[:count]
    local = dict(zip(keys, items))
    return [broadcast(local[k] if r == w.rank else None, r, w, device) for k, r in owned]


# --------------------------------------------------------------------------- #
# Solve units
# --------------------------------------------------------------------------- #
@dataclass
class SolveUnit:
    """One piece of a block's work that one rank does for all: ``solve()``
    returns its result (tensors in any nest), broadcast to every rank."""

    name: str
    cost: float
    solve: Callable[[], Any]


def assign(costs: Sequence[float], size: int, among: Optional[Sequence[int]] = None) -> list[int]:
    """Owner rank of each unit: longest first (ties by position) to the least
    loaded rank of ``among`` (default: all; ties to the lowest rank).
    Deterministic for given costs."""
    ranks = list(range(size)) if among is None else list(among)
    load = dict.fromkeys(ranks, 0.0)
    owners = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        r = min(ranks, key=lambda r: (load[r], r))
        owners[i] = r
        load[r] += costs[i]
    return owners


def run_units(units: Sequence[SolveUnit], w: World, device, owners: Optional[Sequence[int]] = None,
              among: Optional[Sequence[int]] = None) -> list:
    """Every unit's result on every rank: each rank solves the units it owns
    (``owners``, default ``assign`` by cost over ``among``), then each is
    broadcast from its owner."""
    owners = list(owners) if owners is not None else assign([u.cost for u in units], w.size, among)
    results = [u.solve() if owner == w.rank else None for u, owner in zip(units, owners)]
    return [broadcast(r, owner, w, device) for r, owner in zip(results, owners)]


# --------------------------------------------------------------------------- #
# Reporting
# --------------------------------------------------------------------------- #
def gather_report(entry: dict, w: World) -> list:
    """Every rank's ``entry`` (small plain values), in rank order."""
    import torch.distributed as dist

    if not w.parallel:
        return [entry]
    out = [None] * w.size
    dist.all_gather_object(out, entry)
    return out


__all__ = ["COLLECTIVE_TIMEOUT", "DEAD_AFTER_S", "SINGLE", "DistributedError", "PeerFailed", "SolveUnit", "World", "assign",
           "broadcast", "env_world", "gather_first", "gather_report", "launch", "max_over_ranks",
           "rank_device", "run_units", "shard", "sum_in_rank_order", "sum_int", "world"]
