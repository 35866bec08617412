"""An engine server's lifecycle, whatever the engine: start it in its own process group with a pid file,
wait until it answers its health path while following its log, and stop it with nothing left behind.

A server runs in its own session so that stopping it reaches every worker; a pid file lets the next start
find and stop a server left by a crashed run; a start that exits early or whose log stops moving fails at
once with the log's last lines; on GPUs the stop waits until the memory is released, so the next phase's
engine can load. `engine.VllmServer` and `sglang.SglangServer` differ only in their command line, their
environment, their health path and what their log says about the weight load.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time
from collections import deque
from pathlib import Path
from types import TracebackType

import httpx
import psutil

from eagle3_core.config import ServerConfig
from eagle3_core.events import DECISION, ENGINE_START, ENGINE_STOP, WEIGHT_LOAD, RunEvents
from eagle3_core.hosts import HostSlice
from eagle3_core.progress import ProgressCallback, ignore_progress
from eagle3_core.run_layout import RunLayout
from eagle3_core.serving.parent_death import die_with_parent
from eagle3_core.serving.processes import (
    POLL_S,
    ServerError,
    kill_tree,
    live_owner,
    read_pid_file,
    stop_server,
    wait_gpu_release,
    write_pid_file,
)

LOG_TAIL_LINES = 40
ERROR_LINE = re.compile(r"\bERROR\b|^Traceback|^[\w.]+(Error|Exception)\b|out of memory")
ERROR_LINES = 8


class PortInUseError(ServerError):
    """The configured port is taken by another process."""


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


class EngineServer:
    """A server process this process starts and stops. `with Server(...) as server:` stops it on any exit;
    the pid file `<run_dir>/server/<phase>.pid` lets the next start stop it after a crash. `phase` is the
    caller's label for the pid file, the log and the events lines (this layer knows no phase: "engine"
    when not given). `part`, a host's slice of a run spread over hosts, gives the engine its own pid file
    and log (`<phase>-host-<i>-of-<N>.pid`), and its start stops only that slice's leftovers: the hosts
    share `server/`. A subclass gives `engine` (its name in messages), `health_path`, `command()` and
    `environment()`, and may read its log's lines in `on_log_line` (weight-load progress)."""

    engine = "engine"
    health_path = "/health"
    health_timeout_s = 2.0

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
        self.api_key = self.read_api_key()
        self.port = config.port
        self.process: subprocess.Popen[bytes] | None = None
        self.started = 0.0
        self.load_seconds: float | None = None  # what the engine's log said its weight load took, if it did

    @property
    def base_url(self) -> str:
        return f"http://{self.config.host}:{self.port}"

    def read_api_key(self) -> str | None:
        """The key the server is started with and its clients send; None: none."""
        return None

    def command(self) -> list[str]:
        """The server's argv, for `self.port`."""
        raise NotImplementedError

    def environment(self) -> dict[str, str]:
        """The server's environment."""
        raise NotImplementedError

    def on_log_line(self, line: str) -> None:
        """One line of the server's log while it starts."""

    def start(self) -> EngineServer:
        """Launch the server and block until its health path answers."""
        self.stop_stale()
        self.port = self.config.port or free_port(self.config.host)
        check_port_free(self.config.host, self.port)
        command = self.command()
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
                env=self.environment(),
                start_new_session=True,
                preexec_fn=die_with_parent(signal.SIGTERM),  # not orphaned if this process is killed
            )
        self.started = write_pid_file(self.pid_file, self.process.pid, port=self.port, command=command)
        self.events.record(
            self.phase,
            ENGINE_START,
            f"started {self.engine} server pid {self.process.pid} on {self.base_url}",
            pid=self.process.pid,
            port=self.port,
            command=command,
            log=str(self.log_path),
        )
        try:
            self.wait_healthy(LogTail(self.log_path))
        except BaseException:
            self.stop()
            raise
        startup_s = time.monotonic() - launched
        seconds = self.load_seconds if self.load_seconds is not None else startup_s
        self.events.record(
            self.phase,
            WEIGHT_LOAD,
            f"{self.engine} loaded {self.model_dir.name} in {seconds:.1f} s (healthy after {startup_s:.1f} s)",
            what=f"{self.engine} server {self.model_dir}",
            seconds=seconds,
            startup_s=startup_s,
            source="log" if self.load_seconds is not None else "measured",
        )
        return self

    def wait_healthy(self, tail: LogTail) -> None:
        """Poll the health path while following the log. Fails on exit, on a log silent for
        `stall_timeout_s`, or after `startup_timeout_s`."""
        deadline = time.monotonic() + self.config.startup_timeout_s
        while True:
            # Health and exit first, the log after: every line written before either is then parsed.
            healthy = self.healthy()
            exit_code = self.process.poll() if self.process is not None else None
            for line in tail.read_lines():
                self.on_log_line(line)
            if healthy:
                return
            if exit_code is not None:
                self.fail(f"{self.engine} server exited with code {exit_code} while starting", tail)
            if tail.idle_s() > self.config.stall_timeout_s:
                self.fail(f"{self.engine} server stalled: no log output for {tail.idle_s():.0f} s while starting", tail)
            if time.monotonic() > deadline:
                self.fail(f"{self.engine} server not healthy after {self.config.startup_timeout_s:.0f} s", tail)
            time.sleep(POLL_S)

    def fail(self, reason: str, tail: LogTail) -> None:
        tail.read_lines()
        raise ServerError(f"{reason}; log {self.log_path}, last lines:\n{tail.tail_text()}")

    def healthy(self) -> bool:
        try:
            response = httpx.get(f"{self.base_url}{self.health_path}", timeout=self.health_timeout_s)
            return response.status_code == 200
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
            f"{self.engine} server pid {self.process.pid} ({self.phase}) died: {exit_description(returncode)}; "
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
            f"stopped {self.engine} server pid {pid} in {time.monotonic() - begun:.1f} s",
            pid=pid,
            processes=sorted(pids),
            sigkill=killed,
        )

    def stop_stale(self) -> None:
        """Stop every server a crashed run of this run directory (of this slice) left behind on this host
        (found by pid file, its owner gone), whichever engine it was. A live owner's server is left running."""
        for pid_file in self.layout.pid_files():
            owner = live_owner(read_pid_file(pid_file) or {})
            if owner is not None:
                self.events.record(
                    self.phase,
                    DECISION,
                    f"left the server of {pid_file.name} running: its owner, pid {owner.pid} on {owner.host}, is alive",
                    owner_pid=owner.pid,
                )
                continue
            stopped = stop_server(pid_file, self.config.stop_grace_s, self.config.gpu_release_timeout_s)
            if stopped:
                self.events.record(
                    self.phase,
                    ENGINE_STOP,
                    f"stopped stale server from {pid_file.name} before starting {self.engine}",
                    processes=sorted(stopped),
                    stale=True,
                )

    def __enter__(self) -> EngineServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
