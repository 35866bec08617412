"""One declaration per phase: its name, its format version and the parts of the configuration it reads.
Which of those fields change what the phase produces is marked on the fields themselves (`config.roles`);
both the core's resume keys and the Prefect cache policies of `tasks/` are derived from those marks here,
so the two never disagree about a field."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from eagle3_core.config import (
    CONTENT,
    EVERY_PHASE,
    INPUT,
    PHASE_ROLES,
    UNKEYED_AT_DEFAULT,
    VERDICT,
    VLLM,
    PipelineConfig,
    Role,
)
from eagle3_core.dtypes import with_resolved_dtypes
from eagle3_core.server_defaults import completion_args, with_resolved_server

# Roles whose fields enter the Prefect cache key: every field that is not operational.
KEYED_ROLES: tuple[Role, ...] = (CONTENT, INPUT, VLLM, VERDICT)
EVERY_PHASE_READS = ("run_dir", "orchestration")


@dataclass(frozen=True)
class PhaseSpec:
    """A phase as its cache keys see it. `reads`: dotted config paths (sections or fields) the phase reads;
    each field under them has a role for this phase (checked by tests/unit/eagle3_core/test_phase_roles.py)."""

    name: str
    version: int
    reads: tuple[str, ...]

    def reads_field(self, path: str) -> bool:
        return any(path == prefix or path.startswith(prefix + ".") for prefix in (*EVERY_PHASE_READS, *self.reads))


# prepare_target 2: the TargetModel records the text config (`text`), so a stored result without it is not reused.
PREPARE_TARGET = PhaseSpec("prepare_target", 2, ("target",))
SAMPLING = PhaseSpec("sampling", 1, ("server", "sampling"))
EXTRACTION = PhaseSpec(
    "extraction", 1, ("server", "extraction", "sampling.holdout_fraction", "sampling.request_timeout_s")
)
VOCAB = PhaseSpec("vocab", 1, ("vocab", "sampling.holdout_fraction"))
TRAINING = PhaseSpec("training", 1, ("training", "export.engines"))
EVALUATION = PhaseSpec(
    "evaluation", 1, ("server", "evaluation", "sampling.holdout_fraction", "sampling.request_timeout_s")
)
# Phases whose results hold what the engine computes, not how fast: speed flags of server.extra_args are not keyed.
SPEED_BLIND = (SAMPLING.name, EXTRACTION.name)
PHASES = (PREPARE_TARGET, SAMPLING, EXTRACTION, VOCAB, TRAINING, EVALUATION)


def config_fields(model: type[BaseModel] = PipelineConfig, prefix: str = "") -> Iterator[tuple[str, FieldInfo]]:
    """(dotted path, field) of every leaf field of the configuration tree."""
    for name, info in model.model_fields.items():
        annotation = info.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            yield from config_fields(annotation, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}", info


def marked(info: FieldInfo) -> dict[str, Any]:
    """The field's `json_schema_extra` (its marks), {} where it has none."""
    return info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}


def marked_roles(info: FieldInfo) -> dict[str, Role]:
    """Phase name -> role, as the field's `json_schema_extra` marks it."""
    return dict(marked(info).get(PHASE_ROLES) or {})  # type: ignore[arg-type]


@cache
def field_roles(phase: str) -> dict[str, Role]:
    """Dotted path -> role of every field marked for `phase` (or for every phase)."""
    marked = ((path, marked_roles(info)) for path, info in config_fields())
    return {path: role for path, by_phase in marked if (role := by_phase.get(phase, by_phase.get(EVERY_PHASE)))}


@cache
def unkeyed_defaults() -> dict[str, Any]:
    """Dotted path -> the default each field marked UNKEYED_AT_DEFAULT (`config.added_content`) was added with."""
    defaults = {}
    for path, info in config_fields():
        if mark := marked(info).get(UNKEYED_AT_DEFAULT):
            defaults[path] = mark["since"] if isinstance(mark, dict) else info.get_default(call_default_factory=True)
    return defaults


def keyed_fields(config: PipelineConfig, phase: str, keyed: tuple[Role, ...] = (CONTENT,)) -> dict[str, Any]:
    """The values of `phase`'s fields whose role is in `keyed`, as {section: {field: value}} (top-level
    fields as {field: value}), with `auto` compute dtypes and server fields resolved as this host runs them:
    `auto` and the value it stands for share every key; sampling and extraction key only the engine arguments
    that may change what they produce (`server_defaults.completion_args`). A field added after runs were keyed
    is left out at its default (`unkeyed_defaults`), so the keys of those runs stay what they were."""
    data = with_resolved_server(with_resolved_dtypes(config.model_dump(mode="json"), config), config)
    if phase in SPEED_BLIND:
        data["server"]["extra_args"] = completion_args(data["server"]["extra_args"])
    defaults = unkeyed_defaults()
    selected: dict[str, Any] = {}
    for path, role in field_roles(phase).items():
        section, _, name = path.rpartition(".")
        value = data[section][name] if section else data[name]
        if role not in keyed or (path in defaults and value == defaults[path]):
            continue
        if section:
            selected.setdefault(section, {})[name] = value
        else:
            selected[name] = value
    return selected


def phase_key(config: PipelineConfig, spec: PhaseSpec, keyed: tuple[Role, ...] = (CONTENT,)) -> dict[str, Any]:
    """The resume key of a phase's own folder: its format version and its keyed fields."""
    return {"format_version": spec.version, **keyed_fields(config, spec.name, keyed)}
