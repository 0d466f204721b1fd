"""How a setting meets the command line, said where the setting is declared.

Every setting is a field of one typed record (`operators.config.MethodConfig`,
`connectors.engines.factory.EngineSpec`, `pipeline.job.JobSpec`, ...), declared once with its
type, its default and a pydantic `Field(description=...)`; the commands generate their flags
from those fields (`pipeline.cli.flags`). A flag is `--` and the field's name with dashes unless
the field carries a `Flag` in its `Annotated` metadata saying otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Flag:
    """What a setting's flag does differently from the default one."""

    name: str | None = None  # e.g. "--engine" for `EngineSpec.kind`
    short: str | None = None  # e.g. "-q"
    metavar: str | None = None
    # A boolean that may stay unset: the flag that sets it off (e.g. "--compile"), and its help.
    negative: str | None = None
    negative_help: str | None = None
    # The default as help shows it, where the value alone would mislead (a default chosen by the
    # model, the machine or the work planned).
    default_text: str | None = None
    repeat: bool = False  # a list: the flag is given once per item
