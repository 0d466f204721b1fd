"""`memstream report RUN_DIR`: a run's results as one self-contained HTML page."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from pipeline.report import write_report


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("report", help="write a run's results as one HTML page")
    parser.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="e.g. OUTPUT/RUN_ID")
    parser.add_argument("--out", type=Path, help="the HTML file (default RUN_DIR/report.html)")
    parser.set_defaults(handler=run_report_command)


def run_report_command(args: argparse.Namespace) -> int:
    print(write_report(args.run_dir, args.out))
    return 0
