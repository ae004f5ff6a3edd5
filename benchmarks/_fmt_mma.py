"""Print benchmarks/mma_h200.py's stdout compactly (one line per row)."""
import ast
import sys

for line in sys.stdin:
    line = line.strip()
    try:
        d = ast.literal_eval(line)
        assert isinstance(d, dict)
    except Exception:  # noqa: BLE001
        if line and not line.startswith(("%", "#", "}", "tt.", "scf.", "ttg.", "{-#")):
            print(line[:200])
        continue
    if "shape" in d:
        print(d["shape"], d["m"], "cublas %.1f disp %.1f mma %.1f %s best %s %s err %.2e" % (
            d["cublas_us"], d["dispatch_us"], d["mma_us"], d["mma_cfg"], d.get("best_us"), d.get("best_cfg"), d["err"]))
    else:
        print({k: (round(v, 5) if isinstance(v, float) else v) for k, v in d.items()})
