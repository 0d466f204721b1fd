"""A saved `memstream eval` run's answer steps replayed with this version's answer step, paired:
each chain's final memory as the run saved it, the re-read and the answer prompt as this version
builds them (`MemoryChain` at its answer step), one model call a sample. Re-read changes only the
answer step, and greedy chains are reproducible (a CUAD run's 12 memories came out the same on
two CPUs and dtypes), so this measures a change of the answer step on a run without computing its
memory chains again. Both answers are scored and marked grounded by this version's rules.

    .venv/bin/python bench/answer_replay.py --run bench/results/eval-niah-32k-reread \
        [--method memstream:verified-quotes+reread6000] [--samples N]

Results: bench/results/answer_replay-RUN.json and .md (RUN: the run folder's name), with the CPU
and the dtype.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import Any

import common

from connectors.engines.factory import EngineSpec, load_tokenizer
from operators.core.chain import MemoryChain
from pipeline.evaluation.execution import EvalMethod, grade, prepare_sample
from pipeline.evaluation.regrade import regrade, sample_key
from pipeline.evaluation.run import saved_run


def report(payload: dict[str, Any]) -> str:
    rows, n = payload["rows"], len(payload["rows"])

    def count(key: str, where: str | None = None) -> int:
        return sum(bool(row[key]) and (where is None or bool(row[where])) for row in rows)

    def mark(row: dict[str, Any], which: str) -> str:
        right = f"{row[f'{which}_accuracy']:.2f}"
        grounded = ", grounded" if row[f"{which}_grounded"] else ""
        return f"{row[which]} ({right}{grounded})"

    return "\n".join([
        f"# Answer steps replayed: {payload['run']}",
        "",
        f"{n} samples of `{payload['method']}`, the answer step as this version builds it, on "
        f"{payload['model']} ({payload['dtype']}) with the run's final memories; "
        f"{payload['seconds']:.0f} s for {n} calls, one at a time, the engine's start included.",
        "",
        *common.table(
            ["answers", "accuracy", "all right", "grounded", "grounded and all right"],
            [(which, f"{sum(r[f'{which}_accuracy'] for r in rows) / n:.2f}",
              f"{count(f'{which}_right')}/{n}", count(f"{which}_grounded"),
              count(f"{which}_grounded", f"{which}_right")) for which in ("saved", "replayed")],
        ),
        "",
        f"Replayed all right where the saved answer is not: "
        f"{sum(r['replayed_right'] and not r['saved_right'] for r in rows)}; "
        f"not where it is: {sum(r['saved_right'] and not r['replayed_right'] for r in rows)}.",
        "",
        *common.table(
            ["sample", "gold", "saved", "replayed"],
            [(r["sample"], r["gold"], mark(r, "saved"), mark(r, "replayed")) for r in rows],
        ),
        "",
        f"Command: `{payload['command']}`",
    ])  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", type=Path, required=True, help="a `memstream eval` output folder")
    parser.add_argument("--method", default="memstream:verified-quotes+reread6000")
    parser.add_argument("--samples", type=int, default=None, help="the first N samples")
    parser.add_argument("--kv-cache-gib", type=int, default=2)
    args = parser.parse_args()
    method = EvalMethod.parse(args.method)
    if method.template is None or method.combined:
        raise SystemExit(f"{args.method}: replays the answer step of a memstream method")
    request, metadata, outcome, build = saved_run(args.run, common.CORPORA)
    answered = [
        prediction
        for prediction in outcome.predictions
        if prediction.method == method.name and prediction.status == "ok"
    ][: args.samples]
    if not answered:
        raise SystemExit(f"no answered samples of {method.name} in {args.run}")
    cells = {
        cell: build(*cell) for cell in dict.fromkeys((p.task, p.length_label) for p in answered)
    }
    saved = regrade(answered, lambda task, label: cells[task, label]).predictions
    samples = {sample_key(sample): sample for cell in cells.values() for sample in cell}
    config = request.settings.method_config(method.template, method.reread_tokens)
    spec = EngineSpec(
        model=metadata["model"],
        max_model_len=request.settings.context_window,
        cpu_kvcache_space_gib=args.kv_cache_gib,
        enforce_eager=True,
    ).resolved()
    tokenizer = load_tokenizer(spec)
    chain_config = config.chain()
    chains = []
    for prediction in saved:
        sample = samples[sample_key(prediction)]
        segments = prepare_sample(sample, tokenizer, config).segments
        chains.append(
            MemoryChain(
                prediction.sample_id,
                prediction.question,
                segments,
                chain_config,
                memory=prediction.final_memory or chain_config.templates.initial_memory,
                start_step=len(segments),
            )
        )
    steps = {chain.chain_id: chain.next_request() for chain in chains}
    prompts = {chain_id: step.prompt for chain_id, step in steps.items() if step is not None}
    started = time.perf_counter()
    replies = asyncio.run(
        common.replay_prompts(spec, prompts, config.max_answer_tokens, config.sampling())
    )
    seconds = time.perf_counter() - started
    for chain in chains:
        chain.submit(replies[chain.chain_id].text)
    rows = []
    for prediction, chain in zip(saved, chains, strict=True):
        scores = grade(samples[sample_key(prediction)], chain.answer, chain.raw_response,
                       chain.memory)  # fmt: skip
        rows.append({
            "sample": prediction.sample_id, "gold": prediction.gold[0],
            "saved": prediction.prediction, "saved_accuracy": prediction.scores["accuracy"],
            "saved_right": prediction.scores["accuracy"] >= 1,
            "saved_grounded": prediction.scores["grounded"] >= 1,
            "replayed": chain.answer, "replayed_accuracy": scores["accuracy"],
            "replayed_right": scores["accuracy"] >= 1,
            "replayed_grounded": scores["grounded"] >= 1,
            "reread_passages": [passage.index for passage in chain.reread],
        })  # fmt: skip
    payload = {
        "command": " ".join([".venv/bin/python bench/answer_replay.py", *sys.argv[1:]]),
        "run": args.run.name, "method": method.name, "model": metadata["model"],
        "dtype": spec.dtype, "seconds": seconds, "rows": rows,
    }  # fmt: skip
    common.write_results(f"answer_replay-{args.run.name}", payload, report(payload))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
