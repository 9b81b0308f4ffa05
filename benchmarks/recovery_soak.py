"""Soak test for surviving a lost rank: many runs per kill point, victims varied.

Each run is the end-to-end harness of ``tests/recovery/test_recovery.py``: 4 gloo ranks train a small
GPT for 3 steps with ``keep_neighbour_copies``; in step 1 one rank SIGKILLs itself at the kill
point (forward, backward, inside a gradient reduction, inside ``optimizer.step()``, or between
steps) and the survivors call ``rebuild_on_survivors`` and redo the step. A run passes when
every survivor recovers (no ``UnrecoverableLossError``, no live rank declared lost) and ends
equal to the failure-free run. Prints one line per run and a summary per kill point.

    python benchmarks/recovery_soak.py --runs 50            # 50 per kill point
    python benchmarks/recovery_soak.py --points backward --runs 10
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

_TESTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests")
sys.path[:0] = [os.path.join(_TESTS, "recovery"), _TESTS]

import test_recovery as harness  # noqa: E402  (found through the path above)

POINTS = ("forward", "backward", "reduce_scatter", "optimizer", "between")

# Registered at import: the ranks (spawned) import this module as their main module first.
for _point in POINTS:
    for _victim in range(harness.WORLD):
        harness.SCENARIOS[f"soak_{_point}_{_victim}"] = {
            "steps": 3,
            "repro": False,
            "kills": [(1, _victim, _point)],
        }


def _one(point: str, victim: int) -> tuple[bool, str]:
    t0 = time.monotonic()
    try:
        results = harness._world(f"soak_{point}_{victim}", tempfile.mkdtemp())
    except Exception as e:  # a survivor failed: its traceback's last error line
        lines = [ln for ln in str(e).splitlines() if "Error" in ln]
        return False, f"{lines[-1] if lines else e} ({time.monotonic() - t0:.1f} s)"
    bad = []
    for rank, res in results.items():
        if "events" not in res or len(res["events"]) != 1:
            bad.append(f"rank {rank}: {sorted(res)}")
            continue
        diff = max(abs(res["final"][k] - res["reference"][k]).max() for k in res["reference"])
        if diff > 1e-5:
            bad.append(f"rank {rank}: {diff:.2e} from the failure-free run")
    detect = max(e["detect_s"] for r in results.values() for e in r.get("events", []))
    first = max(e["to_first_step_s"] for r in results.values() for e in r.get("events", []))
    text = f"detected {detect * 1e3:.0f} ms, next step done {first:.2f} s after the kill"
    return not bad, (("; ".join(bad) + "; ") if bad else "") + text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=10, help="runs per kill point")
    ap.add_argument("--points", default=",".join(POINTS))
    args = ap.parse_args()
    summary = {}
    for point in args.points.split(","):
        ok = 0
        for i in range(args.runs):
            victim = i % harness.WORLD
            passed, text = _one(point, victim)
            ok += passed
            print(f"{'ok  ' if passed else 'FAIL'} {point:15s} victim {victim}: {text}", flush=True)
        summary[point] = (ok, args.runs)
    print("\nsummary (recovered / runs):")
    for point, (ok, n) in summary.items():
        print(f"  {point:15s} {ok} / {n}")


if __name__ == "__main__":
    main()
