"""The run, resolved once: the config with every `auto` server field replaced by its value on a host, and every
`auto` (server fields, compute dtypes, training processes) with its value and the reason in `choices`;
built from the config, the host's `DeviceFacts` and the target reference (`target.reference`: its config.json,
so a Hub id is sized by its real config before anything is downloaded). `eagle3 plan`, `eagle3 doctor`, every
CLI command and the flow build one (`resolve_run`) and hand its `config` on; the choices themselves are the
pure functions of `server_defaults` (server fields), `dtypes` (compute dtypes) and `resolve_processes`
(training processes, the same rule the training launcher applies).

A phase handed a config whose `auto` fields are already values decides nothing again: its engine and its
keys read the values.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from eagle3_core.config import ConfigError, PipelineConfig
from eagle3_core.devices import DeviceFacts, host_facts
from eagle3_core.dtypes import AUTO, choose_dtype
from eagle3_core.events import DECISION, RunEvents
from eagle3_core.server_defaults import AUTO_FIELDS, Choice, device_env, server_choices
from eagle3_core.target.hub import HubTargetError
from eagle3_core.target.reference import TargetNotFound, TargetReference, TargetShape, reference_of, target_shape

DTYPE_FIELDS = ("server.dtype", "extraction.compute_dtype", "evaluation.dtype")
# Choices the resolved config keeps as `auto` (each decided by the same function where it runs): compute dtypes
# (`dtypes` keys and records them alike) and training.processes (a multi-host run trains on other hosts than the
# flow's: each launcher applies `resolve_processes` to its own GPUs).
KEPT_AUTO = (*DTYPE_FIELDS, "training.processes")


def resolve_processes(setting: int | str, device: str, visible: int) -> int:
    """`training.processes` on a host of `visible` GPUs: `auto` is one process per visible CUDA device where
    training runs on CUDA (`training.device` auto or cuda), else 1; N stays N (N > 1 on a CPU: gloo workers).
    N > 1 on one named GPU, or more CUDA processes than visible devices, is a `ConfigError` naming the fields."""
    per_gpu = device in ("auto", "cuda") and visible > 0
    if setting == "auto":
        return visible if per_gpu else 1
    processes = int(setting)
    if processes > 1 and device.startswith("cuda:"):
        raise ConfigError(
            f"training.processes={processes} with training.device={device}: every rank would train on that one "
            "GPU; set training.device to auto or cuda (rank r takes cuda:r)"
        )
    if per_gpu and processes > visible:
        raise ConfigError(
            f"training.processes={processes}: {visible} CUDA device(s) visible (nvidia-smi, CUDA_VISIBLE_DEVICES)"
        )
    return processes


def runs_on_cuda(device: str, facts: DeviceFacts) -> bool:
    return facts.cuda if device == AUTO else device.startswith("cuda")


def dtype_choices(config: PipelineConfig, facts: DeviceFacts) -> dict[str, Choice]:
    """Every compute dtype -> its value on `facts` (an explicit one stays, with the reason `set`)."""
    devices = {"server.dtype": "auto", "extraction.compute_dtype": config.extraction.device}
    devices["evaluation.dtype"] = config.evaluation.device
    choices = {}
    for path in DTYPE_FIELDS:
        section, name = path.split(".")
        requested = getattr(getattr(config, section), name)
        if requested != AUTO:
            choices[path] = Choice(requested, "set")
            continue
        choice = choose_dtype(runs_on_cuda(devices[path], facts), facts.cpu_flags, facts.cpu_model)
        choices[path] = Choice(choice.dtype, choice.reason)
    return choices


@dataclass(frozen=True)
class ResolvedRun:
    """A config on a host: `config` holds values where the file said `auto`; `choices` says why (dotted path
    -> value and reason); `shape` is the target's config.json when it was needed and found, else `problem`
    says why not."""

    config: PipelineConfig
    facts: DeviceFacts
    reference: TargetReference
    choices: dict[str, Choice]
    shape: TargetShape | None = None
    problem: str | None = None
    processes_problem: str | None = None
    env: dict[str, str] = field(default_factory=dict)

    @property
    def processes(self) -> int:
        """Training processes on this host (the launcher applies the same rule on the host it runs on)."""
        return int(self.choices["training.processes"].value)

    def server_line(self) -> str:
        """One line: what each auto-able server field is on this host and why, and the engine's environment."""
        parts = [
            f"{name} {c.value} (set)" if c.reason == "set" else f"{name} auto -> {c.value} ({c.reason})"
            for name, c in self.choices.items()
            if name in AUTO_FIELDS
        ]
        env = f"engine env {', '.join(f'{k}={v}' for k, v in self.env.items())}" if self.env else "no VLLM_CPU_* env"
        return f"server on {self.facts.describe()}: {'; '.join(parts)}; {env}"

    def record(self, events: RunEvents, phase: str) -> None:
        """The one `decision` line of a run about its server settings and training processes on this host."""
        server = {name: c.value for name, c in self.choices.items() if name in AUTO_FIELDS}
        processes = self.choices["training.processes"]
        line = f"{self.server_line()}; training.processes {processes.value} ({processes.reason})"
        events.record(phase, DECISION, line, server=server, devices=self.facts.describe(), processes=self.processes)


def shape_of(config: PipelineConfig) -> tuple[TargetShape | None, str | None]:
    """The target's config.json (without a weight), or None and why it cannot be read."""
    try:
        return target_shape(reference_of(config.target.model), config.target), None
    except (TargetNotFound, HubTargetError) as exc:
        return None, str(exc)
    except (OSError, ValueError, KeyError) as exc:
        return None, f"target.model {config.target.model}: its config.json cannot be read ({exc})"


def needs_shape(config: PipelineConfig, facts: DeviceFacts) -> bool:
    """Only the tensor-parallel width of a GPU host is chosen by the target's size."""
    return facts.cuda and config.server.tensor_parallel_size == AUTO


def processes_choice(config: PipelineConfig, facts: DeviceFacts) -> tuple[Choice, str | None]:
    tc = config.training
    try:
        value = resolve_processes(tc.processes, tc.device, facts.gpu_count)
    except ConfigError as exc:
        return Choice(tc.processes, "refused"), str(exc)
    reason = "set" if tc.processes != AUTO else f"one a GPU of {facts.gpu_count} on {tc.device}"
    return Choice(value, reason if facts.cuda or tc.processes != AUTO else "one on a CPU host"), None


def resolve_run(
    config: PipelineConfig, facts: DeviceFacts | None = None, shape: TargetShape | None = None
) -> ResolvedRun:
    """`config` on `facts` (default: this host): every `auto` a value, each with its reason. The target's
    config.json is read where a choice needs it (or given as `shape`)."""
    facts = facts or host_facts()
    problem = None
    if shape is None and needs_shape(config, facts):
        shape, problem = shape_of(config)
    choices: dict[str, Any] = dict(server_choices(config.server, facts, shape.size if shape else None))
    if config.training.data == "online" and config.server.data_parallel_size == AUTO:
        # Online, the GPUs beyond one engine's train (`training.placement`); offline they would be more engines.
        choices["data_parallel_size"] = Choice(1, "one engine online: the GPUs beyond it train")
    choices.update(dtype_choices(config, facts))
    choices["training.processes"], processes_problem = processes_choice(config, facts)
    resolved = config.model_copy(deep=True)
    for path, choice in choices.items():
        section, _, name = path.rpartition(".")
        if path not in KEPT_AUTO:
            setattr(getattr(resolved, section or "server"), name, choice.value)
    return ResolvedRun(
        config=resolved,
        facts=facts,
        reference=reference_of(config.target.model),
        choices=choices,
        shape=shape,
        problem=problem,
        processes_problem=processes_problem,
        env=device_env(facts),
    )
