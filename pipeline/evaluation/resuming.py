"""`memstream eval --resume`: whether an earlier run's results may sit in one table with this
run's, and the metadata of a run that continues them.

An earlier run is continued only when it was made the same way (`RESUME_KEYS`, and the same
wording of each memory strategy both measured); results written before a field was recorded are
read with the value it then always had.
"""

from __future__ import annotations

from typing import Any

from operators.config import ConfigError
from pipeline.evaluation.report import RESULTS_JSON, read_results
from pipeline.evaluation.request import EvalRequest
from pipeline.evaluation.suite import SuiteOutcome

# What must match for a resumed run's predictions to sit in one table with the new ones.
RESUME_KEYS = (
    "model", "dtype", "prompt_lookup_tokens", "settings", "samples_per_task_and_length",
    "niah_depths", "corpora",
)  # fmt: skip
# Results written before the dtype was recorded were made in the then hard-coded bfloat16.
DTYPE_BEFORE_IT_WAS_RECORDED = "bfloat16"
# The template sets' wording when results began to record it (`TemplateSet.digest`).
TEMPLATE_DIGESTS_BEFORE_THEY_WERE_RECORDED = {
    "memstream:memagent-reference": "1b97963bc80d",
    "memstream:extractive": "a4c75e0082e5",
    "memstream:append-evidence": "6e1f64c63aff",
    "memstream:segment-first": "dafe8dfd6368",
    "memstream:verified-quotes": "52801cb61e2f",
}


def previous_results(
    request: EvalRequest, metadata: dict[str, Any]
) -> tuple[dict[str, Any], SuiteOutcome] | None:
    """The metadata and outcome an earlier run left in the output folder, if it was made the
    same way."""
    path = request.output / RESULTS_JSON
    if not path.exists():
        return None
    earlier, outcome = read_results(path)
    earlier = {"dtype": DTYPE_BEFORE_IT_WAS_RECORDED, "prompt_lookup_tokens": 0, **earlier}
    differing = [key for key in RESUME_KEYS if earlier.get(key) != metadata[key]]
    earlier_digests = recorded_template_digests(earlier)
    reworded = [
        method
        for method, digest in metadata["template_digests"].items()
        if method in earlier.get("methods", []) and earlier_digests.get(method) != digest
    ]
    if reworded:
        differing.append(f"wording of {', '.join(reworded)} (its prompts changed since)")
    if differing:
        raise ConfigError(
            f"cannot resume: {path} was made with another {', '.join(differing)}; "
            "use the same options or another --output"
        )
    return earlier, outcome


def recorded_template_digests(earlier: dict[str, Any]) -> dict[str, str]:
    """The wording of each memory strategy an earlier run measured."""
    digests = earlier.get("template_digests", TEMPLATE_DIGESTS_BEFORE_THEY_WERE_RECORDED)
    return {method: digests[method] for method in earlier.get("methods", []) if method in digests}


def resumed_metadata(earlier: dict[str, Any], metadata: dict[str, Any]) -> dict[str, Any]:
    """This run's metadata, covering what the earlier runs it continues asked for too."""
    merged = dict(metadata)
    for key in ("tasks", "methods"):
        merged[key] = list(dict.fromkeys([*earlier.get(key, []), *metadata[key]]))
    merged["template_digests"] = {
        **recorded_template_digests(earlier),
        **metadata["template_digests"],
    }
    lengths = {
        length["label"]: length for length in [*earlier.get("lengths", []), *metadata["lengths"]]
    }
    merged["lengths"] = sorted(lengths.values(), key=lambda length: length["tokens"])
    merged["earlier_runs_started_at"] = [
        *earlier.get("earlier_runs_started_at", []),
        earlier.get("started_at"),
    ]
    return merged
