"""What the commands share: exit codes, the user-error type, and the flags of the settings.

A command's flags are generated from the records that declare its settings (`setting_flags`):
one flag per field, its help the field's description with the default, its type and choices the
field's. A flag not given leaves the record's default, so a default is declared once; a command
may give its own (`memstream demo`'s short memory) but not redeclare the setting.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import MISSING, dataclass
from pathlib import Path
from types import UnionType
from typing import (
    Annotated,
    Any,
    Literal,
    TypeVar,
    Union,
    get_args,
    get_origin,
    get_type_hints,
)

import annotated_types
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import ErrorDetails

from connectors.engines.factory import EngineSpec
from operators.config import MethodConfig, parse_config, with_measured_defaults
from operators.core.settings import Flag

EXIT_PARTIAL_FAILURE = 1  # some inputs or questions failed; the rest has results
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130

ModelT = TypeVar("ModelT", bound=BaseModel)


class UserError(Exception):
    """An error the user can fix; printed as one line, never as a traceback."""


def add_verbose_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="show what Ray, vLLM and the model print (by default it goes to a log file)",
    )


@dataclass(frozen=True)
class SettingFlag:
    """The flag of one leaf field of a settings record: `key` in the record at `section` (a key
    of the command's configuration; None: its top level)."""

    section: str | None
    key: str
    info: FieldInfo
    marker: Flag

    @property
    def flag(self) -> str:
        return self.marker.name or "--" + self.key.replace("_", "-")

    @property
    def dest(self) -> str:
        return self.flag.removeprefix("--").replace("-", "_")

    @property
    def kind(self) -> Any:
        """The field's type, `None` taken out of an optional (`int | None` -> int)."""
        return _flag_type(self.info.annotation)

    def help(self, default: Any = MISSING) -> str:
        """The field's description and the default (`shown_default`)."""
        described = self.info.description or ""
        shown = self.shown_default(default)
        return _escape(described if shown is None else f"{described} (default: {shown})")

    def shown_default(self, default: Any = MISSING) -> str | None:
        """The default as help says it: `default` (a command's own), else the one the field
        says, else its value; None for a field that is unset by default."""
        shown = default
        if shown is MISSING:
            shown = self.marker.default_text or self.default
        if shown is MISSING or shown is None:
            return None
        if isinstance(shown, bool):
            return "on" if shown else "off"
        return str(shown)

    @property
    def default(self) -> Any:
        if self.info.default_factory is not None:
            return self.info.default_factory()  # type: ignore[call-arg]
        return MISSING if self.info.is_required() else self.info.default


def setting_flags(
    record: type,
    section: str | None = None,
    *,
    only: Sequence[str] | None = None,
    exclude: Collection[str] = (),
) -> list[SettingFlag]:
    """One flag per leaf field of `record` (a dataclass or a pydantic model) that a command line
    can give: a value, an optional value, a choice or a list of strings. Sections (records in the
    record) and mappings are left to the configuration files."""
    fields = settings_fields(record)
    names = list(fields) if only is None else list(only)
    flags = []
    for name in names:
        info = fields[name]
        if name in exclude or not _flaggable(info.annotation):
            continue
        marker = next((item for item in info.metadata if isinstance(item, Flag)), Flag())
        flags.append(SettingFlag(section, name, info, marker))
    return flags


def settings_fields(record: type) -> dict[str, FieldInfo]:
    """The fields of a settings record, each with its type, default, description and metadata
    (`Annotated` in a dataclass, as pydantic reads it)."""
    if isinstance(record, type) and issubclass(record, BaseModel):
        return {name: _described(info) for name, info in record.model_fields.items()}
    hints = get_type_hints(record, include_extras=True)
    fields = {}
    for field in dataclasses.fields(record):
        if not field.init:
            continue
        if field.default is not MISSING:
            info = FieldInfo.from_annotated_attribute(hints[field.name], field.default)
        else:
            info = FieldInfo.from_annotation(hints[field.name])
            if field.default_factory is not MISSING:
                info.default_factory = field.default_factory
        fields[field.name] = info
    return {name: _described(info) for name, info in fields.items()}


def is_section(info: FieldInfo) -> bool:
    """Whether a field is a record of its own (a section of a configuration), not a setting."""
    kind = _flag_type(info.annotation)
    return dataclasses.is_dataclass(kind) or (
        isinstance(kind, type) and issubclass(kind, BaseModel)
    )


def _described(info: FieldInfo) -> FieldInfo:
    """An optional setting (`MaxModelLen | None`) with the description and metadata of the
    setting it makes optional, which pydantic leaves inside the union."""
    if info.description is not None or get_origin(info.annotation) not in (Union, UnionType):
        return info
    for member in get_args(info.annotation):
        if get_origin(member) is Annotated:
            inner = FieldInfo.from_annotation(member)
            lifted = copy.copy(info)
            lifted.description = inner.description
            lifted.metadata = [*inner.metadata, *info.metadata]
            return lifted
    return info


def add_setting_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    flags: Sequence[SettingFlag],
    defaults: Mapping[str, Any] | None = None,
    shown_defaults: Mapping[str, str] | None = None,
) -> None:
    """Adds `flags`, help from the fields' descriptions. A flag not given leaves its attribute
    out of the parsed arguments, so the record's own default applies (`setting_overrides`),
    unless `defaults` (by field name) gives the command's own default; `shown_defaults` says
    the default in help where a command resolves it itself."""
    defaults = defaults or {}
    shown_defaults = shown_defaults or {}
    for setting in flags:
        names = [setting.flag] if setting.marker.short is None else [setting.marker.short]
        if setting.marker.short is not None:
            names.append(setting.flag)
        default = defaults.get(setting.key, argparse.SUPPRESS)
        shown = shown_defaults.get(setting.key, defaults.get(setting.key, MISSING))
        options: dict[str, Any] = {
            "dest": setting.dest,
            "default": default,
            "help": setting.help(shown),
        }
        if setting.default is MISSING and setting.section is None and not setting.marker.repeat:
            options["required"] = True
        if setting.marker.metavar:
            options["metavar"] = setting.marker.metavar
        kind = setting.kind
        if setting.marker.negative is not None:
            modes = parser.add_mutually_exclusive_group()
            modes.add_argument(*names, action="store_const", const=True, **options)
            modes.add_argument(
                setting.marker.negative,
                dest=setting.dest,
                action="store_const",
                const=False,
                default=default,
                help=_escape(setting.marker.negative_help or ""),
            )
            continue
        if kind is bool:
            options["action"] = argparse.BooleanOptionalAction
        elif setting.marker.repeat:
            options["action"] = "append"
        elif get_origin(kind) is Literal:
            options["choices"] = get_args(kind)
        else:
            options["type"] = _parse_type(kind, setting.info.metadata)
        parser.add_argument(*names, **options)


def setting_overrides(args: argparse.Namespace, flags: Sequence[SettingFlag]) -> dict[str, Any]:
    """The settings the flags gave, as a configuration file would (`{section: {key: value}}`,
    top-level keys at the top)."""
    overrides: dict[str, Any] = {}
    for setting in flags:
        if hasattr(args, setting.dest):
            target = overrides.setdefault(setting.section, {}) if setting.section else overrides
            target[setting.key] = getattr(args, setting.dest)
    return overrides


def positive_int(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return number


def positive_float(value: str) -> float:
    number = float(value)
    if not number > 0:  # NaN too
        raise argparse.ArgumentTypeError(f"must be a positive number, got {value}")
    return number


def add_model_flags(parser: argparse.ArgumentParser, model: type[BaseModel]) -> None:
    """One flag per field of a pydantic model, named after it (`max_memory_tokens` ->
    `--max-memory-tokens`), with its description as help and its default; booleans get
    `--x/--no-x`, literals their choices. The model validates the values (`model_from_flags`),
    so the flags, the YAML and the Python API cannot drift apart."""
    add_setting_flags(parser, setting_flags(model))


def model_from_flags(model: type[ModelT], args: argparse.Namespace) -> ModelT:
    """The model from the flags given; a value it refuses is a UserError naming the flag."""
    values = setting_overrides(args, setting_flags(model))
    try:
        return model.model_validate(values)
    except ValidationError as error:
        raise UserError("; ".join(map(_flag_problem, error.errors()))) from None


def _flag_problem(problem: ErrorDetails) -> str:
    """A field's problem names its flag; a check across fields (no `loc`) says it all itself."""
    if not problem["loc"]:
        return problem["msg"].removeprefix("Value error, ")
    return f"--{str(problem['loc'][0]).replace('_', '-')}: {problem['msg']}"


def _flaggable(annotation: Any) -> bool:
    kind = _flag_type(annotation)
    if get_origin(kind) is tuple:  # a list of strings, given once per item
        return all(member is Ellipsis or _flag_type(member) is str for member in get_args(kind))
    if get_origin(kind) is Literal:
        return True
    return kind in (str, int, float, bool, Path)


def _parse_type(kind: Any, metadata: Sequence[Any]) -> Callable[[str], Any]:
    """How argparse reads a value: positive numbers at once, with the bound in the message;
    other bounds are the record's to check, naming the setting."""
    positive = any(
        (isinstance(item, annotated_types.Gt) and item.gt == 0)
        or (isinstance(item, annotated_types.Ge) and item.ge == 1)
        for item in metadata
    )
    if kind is int:
        return positive_int if positive else int
    if kind is float:
        return positive_float if positive else float
    return str if kind is Path else kind  # type: ignore[no-any-return]


def _escape(help_text: str) -> str:
    return help_text.replace("%", "%%")


def _flag_type(annotation: Any) -> Any:
    """The annotation with `None` taken out of an optional (`Path | None` -> Path) and the
    metadata of `Annotated` left out."""
    if get_origin(annotation) is Annotated:
        return _flag_type(get_args(annotation)[0])
    if get_origin(annotation) in (Union, UnionType):
        members = [member for member in get_args(annotation) if member is not type(None)]
        if len(members) == 1:
            return _flag_type(members[0])
        strings = [member for member in members if _flag_type(member) is str]
        if strings:  # a source is a string or a mapping: the command line gives strings
            return str
    return annotation


ENGINE_FLAGS = setting_flags(EngineSpec, "engine")
METHOD_FLAGS = setting_flags(MethodConfig, "method")


def add_engine_arguments(
    parser: argparse.ArgumentParser,
    flags: Sequence[SettingFlag] = ENGINE_FLAGS,
    defaults: Mapping[str, Any] | None = None,
    title: str = "engine",
) -> None:
    add_setting_flags(parser.add_argument_group(title), flags, defaults)


def add_method_arguments(
    parser: argparse.ArgumentParser,
    flags: Sequence[SettingFlag] = METHOD_FLAGS,
    defaults: Mapping[str, Any] | None = None,
    shown_defaults: Mapping[str, str] | None = None,
    title: str = "method",
) -> None:
    add_setting_flags(parser.add_argument_group(title), flags, defaults, shown_defaults)


def engine_spec(args: argparse.Namespace) -> EngineSpec:
    """The engine the flags describe, over `EngineSpec`'s defaults."""
    engine = setting_overrides(args, ENGINE_FLAGS).get("engine", {})
    return parse_config(EngineSpec, engine, "command line")


def method_config(args: argparse.Namespace) -> MethodConfig:
    """The method the flags describe, over `MethodConfig`'s defaults; unless a template is
    given, the model's measured defaults (`operators.config.MEASURED_DEFAULTS`) under the flags."""
    given = with_measured_defaults(setting_overrides(args, [*ENGINE_FLAGS, *METHOD_FLAGS]))
    return parse_config(MethodConfig, given["method"], "command line")
