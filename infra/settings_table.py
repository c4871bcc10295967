"""SETTINGS.md, the table of every public setting, generated from the pydantic settings classes.

python -m infra.settings_table          # rewrite SETTINGS.md
python -m infra.settings_table --check  # exit 1 when SETTINGS.md is not what the classes say
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pydantic import AliasChoices, BaseModel, SecretStr
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from client.settings import CliSettings
from infra.paths import ROOT
from services.control.dashboard.settings import DashboardSettings
from services.control.settings import ControlSettings
from services.ingest.settings import IngestSettings
from services.processor.settings import ProcessorSettings
from services.sink.settings import SinkSettings
from shared.settings import BaseServiceSettings

TABLE = ROOT / "SETTINGS.md"
SECTIONS: tuple[tuple[str, type[BaseModel]], ...] = (
    ("Every service", BaseServiceSettings),
    ("ingest", IngestSettings),
    ("processor", ProcessorSettings),
    ("sink", SinkSettings),
    ("control", ControlSettings),
    ("dashboard (in control)", DashboardSettings),
    ("CLI (`streamforge`)", CliSettings),
)
HEADER = """# Settings

Every setting of the platform, generated from its settings classes by `python -m infra.settings_table`
(a unit test fails when this file and the classes disagree). Each is an environment variable; lists
and maps are JSON. Internal tuning is not here: it lives in each service's `Tuning` dataclass.
"""


def env_name(model: type[BaseModel], name: str, field: FieldInfo) -> str:
    alias = field.validation_alias
    if isinstance(alias, AliasChoices):
        first = alias.choices[0]
        if isinstance(first, str) and first.startswith("SF_"):
            return first
    prefix = str(model.model_config.get("env_prefix", ""))
    return f"{prefix}{name}".upper()


def public_fields(model: type[BaseModel]) -> Iterator[tuple[str, FieldInfo]]:
    """The model's own public fields: not internal, and not inherited from the shared base."""
    inherited = set(BaseServiceSettings.model_fields) if model is not BaseServiceSettings else set()
    for name, field in model.model_fields.items():
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        if name in inherited or extra.get("internal"):
            continue
        yield name, field


def default_text(field: FieldInfo) -> str:
    if field.default_factory is not None:
        value: Any = field.default_factory()  # type: ignore[call-arg]
    elif field.default is PydanticUndefined:
        return "(required)"
    else:
        value = field.default
    if value is None or value == "" or value == [] or value == {}:
        return "—"
    if isinstance(value, SecretStr):
        return "(secret)"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int | float):
        return f"`{value}`"
    return f"`{json.dumps(value) if not isinstance(value, str) else value}`"


def render() -> str:
    lines = [HEADER]
    total = set()
    for title, model in SECTIONS:
        rows = []
        for name, field in public_fields(model):
            env = env_name(model, name, field)
            if env in total:
                continue  # the shared variable, listed once
            total.add(env)
            what = (field.description or "").replace("|", "\\|")
            if not what:
                raise SystemExit(f"{model.__name__}.{name} has no description")
            rows.append(f"| `{env}` | {default_text(field)} | {what} |")
        lines += [f"## {title}", "", "| variable | default | what |", "|---|---|---|", *rows, ""]
    lines.insert(1, f"{len(total)} settings in all.\n")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if TABLE.read_text() != text:
            print(f"{TABLE.name} is stale: run `python -m infra.settings_table`", file=sys.stderr)
            return 1
        return 0
    Path(TABLE).write_text(text)
    print(f"wrote {TABLE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
