"""infra/requirements.lock, the pins of every package of the venv (Airflow's closure included):
its lines are `name==version`, memstream is not among them, and the environment running the
tests has exactly those versions installed (packages the lock does not name are allowed)."""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

from packaging.version import InvalidVersion, Version

LOCK = Path(__file__).resolve().parents[1] / "infra" / "requirements.lock"
LINE = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9][A-Za-z0-9.+!_-]*)$")
# infra/setup.sh uninstalls these after the install: a pin would never be met.
REMOVED = {"torchvision", "torchaudio", "torchcodec", "triton"}
HINT = (
    "if the venv is right, `make lock` rewrites the lock from it; "
    "if the lock is right, `make setup` installs from it"
)


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def same_version(a: str, b: str) -> bool:
    """Equal as versions (pip freeze prints them normalized; metadata may not be), so
    2.13.0 and 2.13.0+cpu differ."""
    try:
        return Version(a) == Version(b)
    except InvalidVersion:
        return a == b


def pins() -> dict[str, tuple[str, str]]:
    """normalized name -> (name as written, version)"""
    out: dict[str, tuple[str, str]] = {}
    for number, raw in enumerate(LOCK.read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = LINE.match(line)
        assert match, f"{LOCK.name}:{number}: not `name==version`: {raw!r}; {HINT}"
        name, version = match.groups()
        assert normalize(name) not in out, f"{LOCK.name}:{number}: {name} pinned twice"
        out[normalize(name)] = (name, version)
    return out


def test_lock_lines_are_pins_without_memstream():
    pinned = pins()
    assert len(pinned) > 100, f"{LOCK} pins only {len(pinned)} packages; {HINT}"
    assert "memstream" not in pinned, f"memstream itself is pinned in {LOCK.name}; {HINT}"
    removed = sorted(REMOVED & pinned.keys())
    assert not removed, f"{LOCK.name} pins {removed}, which infra/setup.sh uninstalls; {HINT}"


def test_installed_versions_match_lock():
    installed: dict[str, str] = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"]
        if name:
            installed.setdefault(normalize(name), dist.version)
    mismatches = []
    for key, (name, version) in sorted(pins().items()):
        have = installed.get(key)
        if have is None:
            mismatches.append(f"{name}: locked {version}, not installed")
        elif not same_version(have, version):
            mismatches.append(f"{name}: locked {version}, installed {have}")
    assert not mismatches, (
        f"{len(mismatches)} package(s) differ from {LOCK}:\n  "
        + "\n  ".join(mismatches)
        + f"\n{HINT}"
    )
