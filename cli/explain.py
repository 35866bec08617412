"""`eagle3 config --explain`: the resolved configuration as YAML (still a config file one can copy), each
field preceded by comments with its description and its role in every phase that reads it, the role that
decides whether changing it runs the phase again (README "Configuration")."""

from __future__ import annotations

import textwrap
from typing import Any

import yaml
from pydantic import BaseModel

from eagle3_core.config import CONTENT, INPUT, OPERATIONAL, VERDICT, VLLM, PipelineConfig
from eagle3_core.phases import PHASES, field_roles, unkeyed_defaults

WIDTH = 116
ROLE_ORDER = (CONTENT, INPUT, VLLM, VERDICT, OPERATIONAL)
ROLE_LEGEND = """\
# Each field: its description, then `roles:` its role in each phase that reads it (eagle3_core/phases.py):
#   content      changes what the phase produces: in its cache key, the phase runs again
#   input        names the phase's input data: keyed by that data's content
#   operational  where and how the phase runs: in no key, a change reuses what is done
#   vllm         changes evaluation's measurement (b) only (the served engine's run)
#   verdict      changes how evaluation judges its saved numbers, not the numbers
"""


def phase_roles(path: str) -> str:
    """`content in sampling; vllm in evaluation; operational in extraction`: the phases reading it, by role."""
    by_role: dict[str, list[str]] = {}
    for spec in PHASES:
        if role := field_roles(spec.name).get(path):
            by_role.setdefault(role, []).append(spec.name)
    if by_role.get(OPERATIONAL) == [spec.name for spec in PHASES]:
        by_role[OPERATIONAL] = ["every phase"]
    roles = [f"{role} in {', '.join(by_role[role])}" for role in ROLE_ORDER if role in by_role]
    if path in unkeyed_defaults():
        roles.append(f"keyed only when not {unkeyed_defaults()[path]!r} (its default when added)")
    return "; ".join(roles) or "read by no phase"


def comment(text: str, indent: int) -> list[str]:
    """`text` as YAML comment lines at `indent`, wrapped to the line length."""
    prefix = " " * indent + "# "
    return textwrap.wrap(text, WIDTH - len(prefix), initial_indent=prefix, subsequent_indent=prefix)


def value_lines(name: str, value: Any, indent: int) -> list[str]:
    """`name: value` as YAML at `indent` (block style for lists and mappings)."""
    text = yaml.safe_dump({name: value}, sort_keys=False, width=WIDTH)
    return [" " * indent + line for line in text.splitlines()]


def explained_fields(model: type[BaseModel], data: dict[str, Any], prefix: str, indent: int) -> list[str]:
    """The comment and YAML lines of every field of `model` (a section: its fields, one level deeper)."""
    lines: list[str] = []
    for name, info in model.model_fields.items():
        annotation, path = info.annotation, f"{prefix}{name}"
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            lines += ["", *comment(info.description or "", indent), " " * indent + f"{name}:"]
            lines += explained_fields(annotation, data[name], f"{path}.", indent + 2)
            continue
        lines += comment(info.description or "", indent) + comment(f"roles: {phase_roles(path)}", indent)
        lines += value_lines(name, data[name], indent)
    return lines


def explained_yaml(config: PipelineConfig) -> str:
    """The resolved configuration as YAML, every field explained in the comments above it."""
    body = explained_fields(PipelineConfig, config.model_dump(mode="json"), "", 0)
    return ROLE_LEGEND + "\n".join(body) + "\n"
