"""Runs the benchmarks one by one and gathers their Markdown into bench/results/SUMMARY.md.

Each runs in its own process, one after the other, so there is never more than one engine.

    .venv/bin/python bench/run.py                    # 2-4 hours on 2 CPU cores (Makefile)
    .venv/bin/python bench/run.py --quick            # small sizes, a few minutes
    .venv/bin/python bench/run.py --with-serving     # also the Ray Serve endpoint (slow)
    .venv/bin/python bench/run.py --only scaling,multi_question

A benchmark that fails is reported as failed and the others still run; the exit status is 1
when any failed.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

from common import RESULTS, table

BENCH = RESULTS.parent
BENCHMARKS = (
    "engine_efficiency",
    "scaling",
    "multi_question",
    "pipeline_overhead",
    "corpus_efficiency",
    "incremental",
    "collection_barrier",
)
SERVING = "bench_serving"
RESULT_NAMES = {SERVING: "serving"}  # script -> the name of its results file, where they differ


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="each benchmark at small sizes")
    parser.add_argument("--with-serving", action="store_true", help="also bench_serving.py")
    parser.add_argument("--only", help=f"comma-separated subset of {', '.join(BENCHMARKS)}")
    args = parser.parse_args()
    names = args.only.split(",") if args.only else [*BENCHMARKS]
    if args.with_serving:
        names.append(SERVING)
    unknown = set(names) - {*BENCHMARKS, SERVING}
    if unknown:
        parser.error(f"unknown benchmark(s): {', '.join(sorted(unknown))}")
    runs, sections = [], []
    # bench_serving uses the test helpers that start and stop `memstream serve` (tests/)
    pythonpath = os.pathsep.join(filter(None, [str(BENCH.parent), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": pythonpath}
    for name in names:
        command = [sys.executable, str(BENCH / f"{name}.py"), *(["--quick"] if args.quick else [])]
        print(f"== {name}: {' '.join(command[1:])}", flush=True)
        started = time.time()
        code = subprocess.run(command, check=False, env=env).returncode
        minutes = (time.time() - started) / 60
        result = RESULTS / f"{RESULT_NAMES.get(name, name)}.md"
        fresh = code == 0 and result.exists() and result.stat().st_mtime >= started
        status = "ok" if fresh else f"failed (exit {code})"
        runs.append((name, status, f"{minutes:.1f}", f"{os.getloadavg()[0]:.1f}"))
        body = result.read_text().strip() if fresh else f"**Failed** (exit code {code})."
        sections += [f"## {name}", "", body, ""]
    summary = "\n".join([
        f"# Benchmarks{' (quick sizes)' if args.quick else ''}, {time.strftime('%Y-%m-%d %H:%M')}",
        "",
        *table(["benchmark", "status", "minutes", "1-min load at end"], runs),
        "",
        f"Total {sum(float(run[2]) for run in runs):.1f} minutes.",
        "",
        *sections,
    ])  # fmt: skip
    (RESULTS / "SUMMARY.md").write_text(summary)
    print(summary)
    return 0 if all(run[1] == "ok" for run in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
