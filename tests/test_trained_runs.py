"""Trained runs as models: `--model <run folder>` resolves to the run's weights, and
`memstream models list` shows the runs under the runs folder with their step and held-out
figures. Fast: the folders hold only the files that are looked at."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from connectors.engines import models
from pipeline.cli.models import run_models_list
from pipeline.training.trainer import CHECKPOINT_DIR


def make_run(folder: Path, *, step: int | None, heldout: dict[str, float] | None) -> Path:
    weights = folder / CHECKPOINT_DIR
    weights.mkdir(parents=True)
    (weights / "config.json").write_text("{}")
    if step is not None:
        (weights / models.RUN_SUMMARY_FILE).write_text(json.dumps({"updates": step}))
    if heldout is not None:  # heldout.jsonl as the trainer writes it: its latest scoring last
        lines = [{"step": 0, "raw": 0.0, "strict": 0.0, "n": 100}, {"step": step, **heldout}]
        (folder / models.RUN_HELDOUT_LINES_FILE).write_text(
            "".join(json.dumps(line) + "\n" for line in lines)
        )
    return folder


def test_a_run_folder_resolves_to_its_weights(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run", step=3, heldout=None)
    assert models.resolve(str(run)) == str((run / CHECKPOINT_DIR).resolve())
    # A model folder itself still resolves to itself.
    assert models.resolve(str(run / CHECKPOINT_DIR)) == str((run / CHECKPOINT_DIR).resolve())


def test_a_folder_without_weights_is_not_a_run(tmp_path: Path) -> None:
    (tmp_path / "empty" / CHECKPOINT_DIR).mkdir(parents=True)
    assert models.trained_run(tmp_path / "empty") is None
    with pytest.raises(models.ModelError, match=r"config\.json"):
        models.resolve(str(tmp_path / "empty"))


def test_trained_runs_reads_step_and_heldout(tmp_path: Path) -> None:
    make_run(tmp_path / "b-run", step=None, heldout=None)
    make_run(tmp_path / "a-run", step=12, heldout={"raw": 0.41, "strict": 0.1, "n": 100})
    (tmp_path / "not-a-run").mkdir()
    runs = models.trained_runs(tmp_path)
    assert [run.path.name for run in runs] == ["a-run", "b-run"]
    assert runs[0].step == 12
    assert runs[0].heldout == {"step": 12, "raw": 0.41, "strict": 0.1, "n": 100}
    assert runs[1].step is None and runs[1].heldout is None
    assert models.trained_runs(tmp_path / "missing") == []


def test_models_list_shows_trained_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = make_run(tmp_path / "demo", step=7, heldout={"raw": 0.5, "strict": 0.25, "n": 100})
    assert run_models_list(argparse.Namespace(runs=tmp_path)) == 0
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if line.startswith("demo "))
    assert "step 7" in line
    assert "held-out raw 0.500" in line and "held-out strict 0.250 (n=100, step 7)" in line
    assert str(run) in line
