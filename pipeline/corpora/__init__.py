"""The shared corpora (never copied into the repository), where `memstream eval` and
`memstream train` both read them: `cuad` holds the contract labels both use."""

from __future__ import annotations

from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[2]
DEFAULT_CORPORA = REPOSITORY.parent / "shared" / "corpora"


def check_root(root: Path) -> Path:
    if not root.is_dir():
        raise FileNotFoundError(f"shared corpora not found at {root}; pass --corpora DIR")
    return root
