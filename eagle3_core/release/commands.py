"""The command lines that serve the target with an exported draft as its EAGLE-3 speculator, in vLLM or SGLang:
the k to serve (`fastest_k`, from the run's evaluation), the engine's argv from the same builders the phases
start their servers with (`serving.engine.build_command`, `serving.sglang.sglang_command`), and that argv as
one shell line with the variables those set (`server_variables`, `sglang_variables`), the API key referenced by
its variable's name and never written.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from eagle3_core.artifacts import EvalReport
from eagle3_core.config import PipelineConfig, env_reference
from eagle3_core.serving.engine import build_command, server_variables, speculative_args
from eagle3_core.serving.sglang import sglang_command, sglang_launch, sglang_variables, speculative_flags

Engine = Literal["vllm", "sglang"]
DEFAULT_K = 3  # the k served when no evaluation says otherwise (= training.ttt_steps' default)
VLLM_KEY_VARIABLE = "VLLM_API_KEY"  # where vLLM reads its API key from


@dataclass(frozen=True)
class KChoice:
    """The k to serve and the one line that says why."""

    k: int
    reason: str


def modelled_speeds(measured: dict[str, Any]) -> list[float]:
    """Tokens per second at k = 1..K from measurement (a)'s pooled result at K: τ(k) over a step's time, the
    target's verification plus k draft passes, both as (a) timed them (`target_s`, `draft_s` over its steps)."""
    acceptance = measured["acceptance"]
    steps, measured_k = acceptance["drafts"], acceptance["k"]
    target_step, draft_pass = measured["target_s"] / steps, measured["draft_s"] / (steps * measured_k)
    return [tau / (target_step + k * draft_pass) for k, tau in enumerate(measured["tau_by_k"], start=1)]


def fastest_k(report: EvalReport | None) -> KChoice:
    """The k the run's evaluation found fastest: the best of (a)'s sweep of k (`modelled_speeds`); the k
    (b) measured where (a) did not run; `DEFAULT_K` without a report."""
    if report is None:
        return KChoice(DEFAULT_K, f"k = {DEFAULT_K}: no evaluation report of this draft")
    sets = (report.measurements.get("transformers") or {}).get("sets") or {}
    pooled = sets.get("all") or next(iter(sets.values()), None)
    if not pooled or not pooled.get("acceptance", {}).get("drafts") or not pooled.get("tau_by_k"):
        return KChoice(report.num_speculative_tokens, f"k = {report.num_speculative_tokens}: the k evaluated")
    speeds = modelled_speeds(pooled)
    k = max(range(1, len(speeds) + 1), key=lambda j: speeds[j - 1])
    return KChoice(
        k,
        f"k = {k}: fastest of k = 1..{len(speeds)} by the evaluation's sweep (τ {pooled['tau_by_k'][k - 1]:.3f}, "
        f"{speeds[k - 1] / speeds[0]:.2f}x the tokens/s of k = 1 at its measured draft and target step times)",
    )


@dataclass(frozen=True)
class ServeCommand:
    """An engine's argv, the variables it sets beside the inherited environment, and where its API key goes:
    `key_variable` (the variable the key is read from) as `key_env` in the environment (vLLM) or after
    `key_flag` on the command line (SGLang)."""

    engine: Engine
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    key_variable: str | None = None
    key_env: str | None = None
    key_flag: str | None = None

    def shell(self) -> str:
        """One shell line; the key and every `$VAR` reference of the variables as `"$VARIABLE"`, expanded by the
        shell that runs it."""
        assignments = [
            f'{name}="${ref}"' if (ref := env_reference(value)) else f"{name}={shlex.quote(value)}"
            for name, value in self.env.items()
        ]
        argv = shlex.join(self.argv)
        if self.key_variable and self.key_env:
            assignments.append(f'{self.key_env}="${self.key_variable}"')
        if self.key_variable and self.key_flag:
            argv += f' {self.key_flag} "${self.key_variable}"'
        return " ".join(["env", *assignments, argv]) if assignments else argv

    def script(self, comment: str) -> str:
        """A shell script that runs `shell()`, with `comment` lines at its top."""
        lines = "".join(f"# {line}\n" for line in comment.splitlines())
        return f"#!/bin/sh\n{lines}exec {self.shell()}\n"


def serve_command(
    config: PipelineConfig, engine: Engine, target_dir: Path | str, draft: Path | str, k: int, port: int
) -> ServeCommand:
    """The command that serves `target_dir` with `draft` (a folder or a Hub id) at k draft tokens, with the
    config's server settings (`server.*`; SGLang's own from `evaluation.sglang_*`) on `port`."""
    server, key_variable = config.server, config.server.api_key_variable()
    if engine == "vllm":
        argv = build_command(server, target_dir, port, speculative_args(draft, k, server.extra_args))
        return ServeCommand(engine, argv, server_variables(server), key_variable, key_env=VLLM_KEY_VARIABLE)
    launch = sglang_launch(config.evaluation)
    extra = config.evaluation.sglang_args + speculative_flags(draft, k)
    argv = sglang_command(server, launch, target_dir, port, extra)
    return ServeCommand(engine, argv, sglang_variables(launch), key_variable, key_flag="--api-key")


def script_path(export_dir: Path, engine: Engine) -> Path:
    """Where the serve command is kept beside the draft: `serve-vllm.sh`, `serve-sglang.sh`."""
    return export_dir / f"serve-{engine}.sh"


def hub_commands(base_model: str, draft: str, k: int) -> dict[Engine, str]:
    """The commands of the model card: the target by its Hub id and the draft by its repo (or folder), with
    the engines' own launchers, as a user types them elsewhere."""
    vllm = shlex.join(["vllm", "serve", base_model, *speculative_args(draft, k, [])])
    sglang = shlex.join(["python", "-m", "sglang.launch_server", "--model-path", base_model,
                         *speculative_flags(draft, k)])  # fmt: skip
    return {"vllm": vllm, "sglang": sglang}
