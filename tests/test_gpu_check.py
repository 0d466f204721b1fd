"""bench/gpu_check.sh on a machine without a usable GPU: one clear line and exit status 2, from
the step that finds it missing (its GPU path has not been run here: these machines have none)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "bench" / "gpu_check.sh"
VENV = Path(sys.executable).parent.parent


def tools(folder: Path, names: list[str]) -> Path:
    """A PATH folder with links to these real commands only."""
    folder.mkdir()
    for name in names:
        found = shutil.which(name)
        assert found, f"{name} is not installed"
        (folder / name).symlink_to(found)
    return folder


def gpu_check(path: str, **env_vars: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PATH": path, "VENV": str(VENV), **env_vars}
    bash = shutil.which("bash")
    assert bash
    return subprocess.run([bash, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=120)


def test_without_nvidia_smi_it_says_so_and_exits_2(tmp_path: Path) -> None:
    result = gpu_check(str(tools(tmp_path / "bin", ["dirname"])))
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == (
        "gpu_check: no usable NVIDIA GPU: nvidia-smi is not installed (no NVIDIA driver)"
    )


def test_with_a_driver_but_a_torch_that_sees_no_gpu_it_says_so_and_exits_2(
    tmp_path: Path,
) -> None:
    """nvidia-smi here is a script that lists a GPU; the torch check is the venv's real one,
    with no CUDA device visible to it (on any machine)."""
    folder = tools(tmp_path / "bin", ["dirname", "timeout"])
    nvidia_smi = folder / "nvidia-smi"
    nvidia_smi.write_text("#!/bin/sh\necho 'NVIDIA L4, 23034 MiB, 550.54.15'\n")
    nvidia_smi.chmod(0o755)
    result = gpu_check(str(folder), CUDA_VISIBLE_DEVICES="")
    assert result.returncode == 2, result.stderr
    assert "gpu_check: nvidia-smi: NVIDIA L4, 23034 MiB, 550.54.15" in result.stdout
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu_check: no usable NVIDIA GPU: torch ")
    assert lines[0].endswith("does not see it")
