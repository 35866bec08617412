"""Every configuration field has a role in every phase that reads it, and the core's resume keys and the
Prefect cache keys follow those roles alike: a field marked content changes both, an operational one
neither (the disagreement of issue 25: `training.sharding` and `server.env` were keyed by one and not by
the other)."""

from __future__ import annotations

import json
import types
import typing
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from eagle3_core.config import CONTENT, EVERY_PHASE, INPUT, OPERATIONAL, VERDICT, VLLM, PipelineConfig
from eagle3_core.dtypes import with_resolved_dtypes
from eagle3_core.phases import PHASES, config_fields, field_roles, marked_roles, unkeyed_defaults
from eagle3_core.server_defaults import with_resolved_server
from tasks.evaluation import POLICY as EVALUATION_POLICY
from tasks.extraction import POLICY as EXTRACTION_POLICY
from tasks.sampling import POLICY as SAMPLING_POLICY
from tasks.target import POLICY as TARGET_POLICY
from tasks.training import POLICY as TRAINING_POLICY
from tasks.vocab import POLICY as VOCAB_POLICY
from tests.helpers.phase_keys import core_key

POLICIES = {
    "prepare_target": TARGET_POLICY,
    "sampling": SAMPLING_POLICY,
    "extraction": EXTRACTION_POLICY,
    "vocab": VOCAB_POLICY,
    "training": TRAINING_POLICY,
    "evaluation": EVALUATION_POLICY,
}


def prefect_key(config: PipelineConfig, phase: str) -> Any:
    return POLICIES[phase].key_content(config, {})


SAMPLES: dict[Any, list[Any]] = {
    bool: [True, False],
    int: [7, 64, 1],
    float: [0.5, 0.25, 2.0],
    str: ["bfloat16", "float16", "elsewhere", "cpu"],  # cpu: the devices (auto, cpu, cuda, cuda:N)
    Path: [Path("elsewhere")],
}
# Fields whose only other values are refused by a validator at the default config, and their base.
BASES = {
    "training.sharding": {"training": {"optimizer": "adamw"}},
    "orchestration.host": {"orchestration": {"hosts": 2}},
    "sampling.responses_per_prompt": {"sampling": {"temperature": 0.5}},
}
VALUES = {
    "extraction.layer_ids": [[2, 7, 20]],  # three ascending ids that fit the target
    "orchestration.timeouts_s": [{"sampling": 60.0}],  # keys are phase names
}


def candidates(annotation: Any) -> list[Any]:
    """Values of a field's type, tried in turn until one is valid and differs from the default."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return list(reversed(args))
    if origin is typing.Annotated:  # PositiveInt and friends: the base type's values, the validator picks
        return candidates(args[0])
    if origin is list:
        return [[item] for item in candidates(args[0])]
    if origin is dict:
        return [{"EXTRA": value} for value in candidates(args[1])]
    if origin in (typing.Union, types.UnionType):
        return [value for arg in args if arg is not type(None) for value in candidates(arg)] + [None]
    return SAMPLES[annotation]


def value_at(data: dict[str, Any], path: str) -> Any:
    section, _, name = path.rpartition(".")
    return data[section][name] if section else data[name]


def resolved(config: PipelineConfig) -> dict[str, Any]:
    """The config as its keys see it: `auto` dtypes and server fields as this host runs them."""
    return with_resolved_server(with_resolved_dtypes(config.model_dump(mode="json"), config), config)


def changed(path: str) -> tuple[PipelineConfig, PipelineConfig]:
    """(base, changed): the default config (or BASES') and a copy with the field at `path` set to another
    valid value that this host resolves differently (`auto` and float32 are one value on a CPU without bf16,
    `auto` and enforce_eager true on any CPU)."""
    base = PipelineConfig.model_validate(BASES.get(path, {}))
    section, _, name = path.rpartition(".")
    before = value_at(resolved(base), path)
    for candidate in VALUES.get(path, []) + candidates(dict(config_fields())[path].annotation):
        config = base.model_copy(deep=True)
        try:
            setattr(getattr(config, section) if section else config, name, candidate)
        except ValidationError:
            continue
        if value_at(resolved(config), path) != before:
            return base, config
    raise AssertionError(f"{path}: no other valid value found to change it to")


@pytest.mark.parametrize("spec", PHASES, ids=lambda spec: spec.name)
def test_every_field_a_phase_reads_has_a_role_for_it_and_no_other_field_does(spec):
    roles = field_roles(spec.name)
    paths = [path for path, _ in config_fields()]
    unclassified = [path for path in paths if spec.reads_field(path) and path not in roles]
    assert not unclassified, f"{spec.name} reads these fields, which carry no role for it: {unclassified}"
    stray = [path for path in roles if not spec.reads_field(path)]
    assert not stray, f"{spec.name} does not read these fields, yet they carry a role for it: {stray}"


def test_every_field_is_read_by_some_phase_and_marks_name_declared_phases():
    names = {spec.name for spec in PHASES} | {EVERY_PHASE}
    for path, info in config_fields():
        marks = marked_roles(info)
        assert marks, f"{path} carries no role for any phase"
        assert set(marks) <= names, f"{path} names an undeclared phase: {sorted(set(marks) - names)}"
        evaluation_only = {phase for phase, role in marks.items() if role in (VLLM, VERDICT)}
        assert evaluation_only <= {"evaluation"}, f"{path}: vllm and verdict are evaluation's roles"


def test_roles_show_in_the_json_schema_of_the_prefect_form():
    schema = PipelineConfig.model_json_schema()
    assert schema["$defs"]["TrainingConfig"]["properties"]["sharding"]["phases"] == {"training": OPERATIONAL}
    assert schema["$defs"]["ServerConfig"]["properties"]["env"]["phases"]["evaluation"] == OPERATIONAL


FIELDS = [(spec.name, path, role) for spec in PHASES for path, role in field_roles(spec.name).items()]


@pytest.mark.parametrize(("phase", "path", "role"), FIELDS, ids=[f"{p}:{f}" for p, f, _ in FIELDS])
def test_core_and_prefect_keys_follow_the_field_role(phase: str, path: str, role: str):
    base, config = changed(path)
    prefect_moved = prefect_key(config, phase) != prefect_key(base, phase)
    assert prefect_moved == (role != OPERATIONAL), f"Prefect key of {phase} and {path} ({role})"
    if role == INPUT or core_key(base, phase) is None:
        return  # keyed by the content of what it names (prompt ids, warm-start files): tests of their own
    before, after = core_key(base, phase), core_key(config, phase)
    if phase == "evaluation":  # (transformers key, vLLM key, verdict)
        moved = tuple(a != b for a, b in zip(before, after, strict=True))
        expected = {CONTENT: (True, True, False), VLLM: (False, True, False), VERDICT: (False, False, True)}
        assert moved == expected.get(role, (False, False, False)), f"evaluation keys and {path} ({role})"
    else:
        assert (after != before) == (role == CONTENT), f"resume key of {phase} and {path} ({role})"


def test_a_field_added_after_runs_were_keyed_is_in_no_key_at_its_default():
    """Fields added after runs were keyed are left out at their defaults: every key is the one of runs made
    before they existed."""
    added = {
        "sampling.responses_per_prompt": 1,
        "training.loss_on_prompt": False,
        "training.input_noise": 0.0,
        "training.ema_decay": None,
        "training.max_epochs": 4.0,
        "training.stop_patience": 1,
        "evaluation.engine": "vllm",
        "evaluation.sglang_args": [],
        "evaluation.sglang_dtype": "bfloat16",
    }
    assert added.items() <= unkeyed_defaults().items()
    config = PipelineConfig()
    for path, value in unkeyed_defaults().items():  # the defaults they were added with
        section, name = path.rsplit(".", 1)
        setattr(getattr(config, section), name, value)
    for phase in POLICIES:
        for path in unkeyed_defaults():
            section, name = path.rsplit(".", 1)
            assert not holds(prefect_key(config, phase), section, name), (phase, path)
            assert not holds(core_key(config, phase), section, name), (phase, path)


def test_a_default_changed_after_it_was_added_is_keyed_at_the_new_default():
    """training.loss_on_prompt and training.input_noise were added off and are on by default now: a run of the
    new defaults must not find the cache of a run made before them (trained without either)."""
    new, old = PipelineConfig(), PipelineConfig()
    assert (new.training.loss_on_prompt, new.training.input_noise) == (True, 0.2)
    old.training.loss_on_prompt, old.training.input_noise = False, 0.0
    assert core_key(new, "training") != core_key(old, "training")
    assert prefect_key(new, "training") != prefect_key(old, "training")
    assert holds(core_key(new, "training"), "training", "loss_on_prompt")
    assert holds(core_key(new, "training"), "training", "input_noise")


def holds(key: Any, section: str, name: str) -> bool:
    """Whether a key (nested dicts, lists, JSON text) holds `name` under `section` anywhere: `engine` of
    `evaluation`, not `server.engine`."""
    if isinstance(key, str) and key.startswith(("{", "[")):
        return holds(json.loads(key), section, name)
    if isinstance(key, dict):
        if isinstance(key.get(section), dict) and name in key[section]:
            return True
        return any(holds(value, section, name) for value in key.values())
    if isinstance(key, list | tuple):
        return any(holds(value, section, name) for value in key)
    return False
