"""Profile input for Nsight Compute: the activation quantize kernel (``launch_quantize``, static
amax, packed codes) on one ``--m`` x ``--k`` bf16 input, ``--rule`` standard or a Four Over Six rule,
launched ``--reps`` times.

    ncu --clock-control none --kernel-name regex:quantize16 --launch-skip 2 --launch-count 1 \\
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \\
        --section SchedulerStats --section Occupancy --section LaunchStats \\
        python3 benchmarks/ncu_quantize.py --m 8192 --k 14336
"""
from __future__ import annotations

import argparse

import torch


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--m", type=int, default=8192)
    parser.add_argument("--k", type=int, default=14336)
    parser.add_argument("--rule", default=None)
    parser.add_argument("--reps", type=int, default=4)
    args = parser.parse_args()
    from fp4ptq.kernels import quantize_kernel as qk

    x = torch.randn(args.m, args.k, device="cuda", generator=torch.Generator(device="cuda").manual_seed(0))
    x = x.bfloat16()
    amax = x.float().abs().amax()
    for _ in range(args.reps):
        qk.launch_quantize(x, amax, args.rule, emit="packed")
    torch.cuda.synchronize()
    print("quantize", args.m, args.k, args.rule, args.reps, "launches")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
