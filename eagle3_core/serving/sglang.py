"""The SGLang server (`python -m sglang.launch_server`), started and stopped by the engine-neutral lifecycle
(`lifecycle.EngineServer`): its command line, its environment and its health path.

SGLang often lives in an environment of its own (its transformers pin must not reach ours), so the
interpreter and the environment are given (`SglangLaunch`). Its `/health_generate` answers only once a
generation went through, so healthy means it can serve. It takes no API key from the environment, only
`--api-key` on the command line (where `ps` would show it): the server is ours, bound to `server.host`,
and started without one.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3_core.config import EvaluationConfig, ServerConfig
from eagle3_core.gpus import has_cuda_gpus
from eagle3_core.server_defaults import concrete_server
from eagle3_core.serving.lifecycle import EngineServer, free_port
from eagle3_core.serving.processes import expand_references

LOAD_END = re.compile(r"Load weight end\. elapsed=(?P<seconds>[\d.]+) s")


@dataclass(frozen=True)
class SglangLaunch:
    """What SGLang is started with beside `server.*`: the interpreter of its environment, its `--dtype`,
    and environment variables of its own."""

    python: str
    dtype: str
    env: dict[str, str] = field(default_factory=dict)


def sglang_launch(evaluation: EvaluationConfig) -> SglangLaunch:
    """The launch `evaluation.sglang_*` describe (the running interpreter where `sglang_python` is None)."""
    return SglangLaunch(evaluation.sglang_python or sys.executable, evaluation.sglang_dtype, evaluation.sglang_env)


def speculative_flags(draft_dir: Path | str, k: int) -> list[str]:
    """SGLang's flags for the draft (a folder or a Hub id): an EAGLE3 chain of k tokens (top-k 1, k steps,
    k + 1 draft tokens)."""
    return ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(draft_dir),
            "--speculative-num-steps", str(k), "--speculative-eagle-topk", "1",
            "--speculative-num-draft-tokens", str(k + 1)]  # fmt: skip


def sglang_command(
    config: ServerConfig, launch: SglangLaunch, model_dir: Path | str, port: int, extra_args: list[str]
) -> list[str]:
    """The server's argv: `server.*` as SGLang's flags (`enforce_eager` as `--disable-cuda-graph`, the GPU
    memory share as `--mem-fraction-static` on CUDA hosts), then `extra_args` (the draft's, the user's)."""
    config = concrete_server(config, model_dir)
    command = [launch.python, "-m", "sglang.launch_server", "--model-path", str(model_dir), "--host", config.host]
    command += ["--port", str(port), "--dtype", launch.dtype, "--tp-size", str(config.tensor_parallel_size)]
    command += ["--context-length", str(config.max_model_len)]
    if has_cuda_gpus():
        command += ["--mem-fraction-static", str(config.gpu_memory_utilization)]
    if config.enforce_eager:
        command.append("--disable-cuda-graph")
    return command + extra_args


def sglang_variables(launch: SglangLaunch) -> dict[str, str]:
    """The variables SGLang is started with beside the parent's environment: offline, unbuffered, the launch's
    own (not `server.env`, which is vLLM's)."""
    return {"HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", **launch.env}


def sglang_env(launch: SglangLaunch) -> dict[str, str]:
    """The parent's environment and `sglang_variables` (their `$VAR` references expanded)."""
    return {**os.environ, **expand_references(sglang_variables(launch))}


def parse_load_end(line: str) -> float | None:
    """Seconds from SGLang's `Load weight end. elapsed=12.34 s, ...`, else None."""
    match = LOAD_END.search(line)
    return float(match["seconds"]) if match else None


class SglangServer(EngineServer):
    """An SGLang server this process starts and stops; the rest of the arguments are `EngineServer`'s."""

    engine = "SGLang"
    health_path = "/health_generate"
    health_timeout_s = 10.0  # a real generation behind it

    def __init__(self, launch: SglangLaunch, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.launch = launch

    def command(self) -> list[str]:
        return sglang_command(self.config, self.launch, self.model_dir, self.port, self.extra_args)

    def environment(self) -> dict[str, str]:
        """`sglang_env`, and a free port of its own for SGLang's gRPC server unless the launch sets one:
        SGLang 0.5.14 takes `--port` + 10000 and refuses to start past 65535, so any port above 55535 the
        system hands out failed the start ("SGLANG_GRPC_PORT (67603) must be between 1 and 65535", found on
        the H200)."""
        return {"SGLANG_GRPC_PORT": str(free_port(self.config.host)), **sglang_env(self.launch)}

    def on_log_line(self, line: str) -> None:
        if self.load_seconds is None:  # the target's load; the draft's comes after
            self.load_seconds = parse_load_end(line)
