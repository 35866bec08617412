"""Every GPU of the host for training, from the flow: the training task starts PyTorch's own launcher,
`python -m torch.distributed.run` (torchrun: its elastic agent, its per-rank logs), running `eagle3 train`
in `training.processes` processes, as a child of the task. Nothing here schedules, restarts or
rendezvouses ranks: torchrun does (`--max-restarts 0`: a failed rank fails the launch; the task's retry
resumes from the last checkpoint).

- How many (`resolve_processes`): `auto` is every visible CUDA device, 1 on a CPU. One process trains in
  the task's own process (`train_draft`: the world of 1 needs no process group, no child to start, and
  keeps the path every single-GPU and CPU run took before); more are launched.
- What the ranks read: the run's config, written to `<run_dir>/draft/launch/config.yaml`, and the task's
  own upstream folders (`eagle3 train --hidden-states --vocab`). The command is the README's hand-run
  `torchrun ... eagle3 train`, so a launched run and a hand-run one train the same draft; the checkpoint
  the ranks leave must record the task's inputs, or the task fails.
- What comes back: `EAGLE3_LAUNCH_DIR` tells the ranks they are launched; rank 0 appends its progress
  updates to `launch/progress.jsonl` (`launched_rank`), which the task tails into its progress callback,
  and the run's `events.jsonl` (every rank writes there) is tailed into the task's log. torchrun keeps each
  rank's stdout, stderr and error record under `launch/logs/<run id>/attempt_0/<rank>/`; the agent's own
  output, with every rank's teed, is `launch/logs/torchrun.log`. The logs of the launch before are kept
  once, as `launch/logs.previous/`.
- A failed rank fails the task with `RankFailed` (`rank_failure`): the rank that failed first, its error,
  traceback and log tail, caused by the rank's own exception.
- Across hosts (`orchestration.hosts` > 1): every host's child run (`orchestration.host` = its node) starts
  its agent with `--nnodes N --node-rank i` and the c10d rendezvous on `orchestration.rendezvous_host:port`,
  its launch folder and pid file its own (`launch/host-<i>-of-<N>/`, `server/training-host-<i>-of-<N>.pid`).
  Every rank runs with `OMP_NUM_THREADS=1` unless it is set (torchrun's own default for more than one
  process a node, also where a node has one), so the layout of nodes does not change the draft
  (`rank_env`).
- Nothing outlives the task: the agent runs in its own process group with the parent-death signal (SIGKILL)
  and a pid file, `<run_dir>/server/training.pid`, as an engine does (the flow's crash and cancel hooks and the
  next launch stop what it names); each rank arms the same signal against its agent; any exit of the task
  (failure, fault, timeout, cancellation) stops the whole tree.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

from eagle3_core.artifacts import DraftCheckpoint, HiddenStateSet, TargetModel, VocabMap
from eagle3_core.config import PipelineConfig, dump_config
from eagle3_core.events import DECISION, RunEvents, parsed_lines
from eagle3_core.files import sha256_json, write_text_atomic
from eagle3_core.hosts import host_slice
from eagle3_core.preflight import visible_gpus
from eagle3_core.progress import ProgressCallback, ProgressUpdate, ignore_progress
from eagle3_core.resolved_run import resolve_processes
from eagle3_core.run_layout import RunLayout
from eagle3_core.serving.lifecycle import LogTail
from eagle3_core.serving.parent_death import die_with_launcher, die_with_parent
from eagle3_core.serving.processes import POLL_S, stop_server, write_pid_file
from eagle3_core.training.phase import (
    PHASE,
    cached_checkpoint,
    phase_config,
    reused_checkpoint,
    train_draft,
    upstream_of,
)
from eagle3_core.training.rank_failure import AGENT_LOG, RankFailed, launch_failure

LAUNCH_ENV = "EAGLE3_LAUNCH_DIR"
CONFIG_FILE = "config.yaml"
PROGRESS_FILE = "progress.jsonl"
LOGS_DIR = "logs"
PREVIOUS_LOGS_DIR = "logs.previous"
# SIGTERM to SIGKILL when the task stops a launch: torchrun's own default shutdown timeout.
STOP_GRACE_S = 30.0
GPU_RELEASE_S = 120.0

LogCallback = Callable[[str], None]
log = logging.getLogger("eagle3.training")


def eagle3_script() -> Path:
    """The `eagle3` console script of this environment (beside its Python), else the one on PATH."""
    beside = Path(sys.executable).with_name("eagle3")
    found = beside if beside.is_file() else Path(shutil.which("eagle3") or "")
    if not found.is_file():
        raise FileNotFoundError(f"no eagle3 command beside {sys.executable} or on PATH: install the package")
    return found


def worker_command(script: Path, config_file: Path, hidden_states: Path, vocab: Path) -> list[str]:
    """What every rank runs: `eagle3 train` on the task's config and upstream folders."""
    return [str(script), "train", "-c", str(config_file), "--hidden-states", str(hidden_states), "--vocab", str(vocab)]


@dataclass(frozen=True)
class Rendezvous:
    """torchrun's c10d rendezvous of a training spread over hosts: this host is node `node` of `nodes`; the
    node whose name is the endpoint's hosts the store. `run_id` keeps two runs' nodes apart."""

    nodes: int
    node: int
    endpoint: str
    run_id: str

    @classmethod
    def of(cls, config: PipelineConfig) -> Rendezvous | None:
        """This host's part in a training over `orchestration.hosts` hosts (its child run sets
        `orchestration.host`); None for a training on one host."""
        part, orchestration = host_slice(config), config.orchestration
        if part is None:
            return None
        endpoint = f"{orchestration.rendezvous_host}:{orchestration.rendezvous_port}"
        return cls(part.hosts, part.host, endpoint, "eagle3-" + sha256_json(str(Path(config.run_dir).resolve()))[:16])

    def args(self) -> list[str]:
        return [
            *("--nnodes", str(self.nodes), "--node-rank", str(self.node)),
            *("--rdzv-backend", "c10d", "--rdzv-endpoint", self.endpoint, "--rdzv-id", self.run_id),
        ]


def torchrun_command(
    processes: int, log_dir: Path, worker: list[str], rendezvous: Rendezvous | None = None
) -> list[str]:
    """PyTorch's launcher on this host: `processes` workers of a standalone c10d rendezvous on a free port,
    or of `rendezvous` across hosts; no restarts, every rank's stdout and stderr kept under `log_dir` and
    teed to the agent's output."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *(["--standalone", "--nnodes", "1"] if rendezvous is None else rendezvous.args()),
        "--nproc-per-node",
        str(processes),
        "--max-restarts",
        "0",
        "--log-dir",
        str(log_dir),
        "--redirects",
        "3",
        "--tee",
        "3",
        *worker,
    ]


@contextmanager
def progress_writer(path: Path) -> Iterator[ProgressCallback]:
    """A callback appending each update to `path` as one JSON line, in one O_APPEND write."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(update: ProgressUpdate) -> None:
        os.write(fd, (update.model_dump_json() + "\n").encode())

    try:
        yield write
    finally:
        os.close(fd)


def launched_rank() -> AbstractContextManager[ProgressCallback] | None:
    """In a rank of a launch (`EAGLE3_LAUNCH_DIR` set): arm the parent-death signal against the agent, and
    give the progress callback: rank 0's updates go to the launch's progress file, the other ranks' nowhere.
    None outside a launch (a plain `eagle3 train`, or one under a hand-run torchrun)."""
    launch_dir = os.environ.get(LAUNCH_ENV)
    if launch_dir is None:
        return None
    die_with_launcher(signal.SIGTERM)
    if int(os.environ.get("RANK", "0")) != 0:
        return nullcontext(ignore_progress)
    return progress_writer(Path(launch_dir) / PROGRESS_FILE)


class TorchrunLaunch:
    """The agent of one launch: started in its own process group, with the parent-death signal and a pid
    file; `stop()` ends its whole tree (every rank included) and may be called twice."""

    def __init__(self, command: list[str], env: dict[str, str], log_path: Path, pid_file: Path):
        self.command, self.env, self.log_path, self.pid_file = command, env, log_path, pid_file
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> subprocess.Popen[bytes]:
        stop_server(self.pid_file, STOP_GRACE_S, GPU_RELEASE_S)  # a launch left by a killed run
        self.pid_file.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as out:
            self.process = subprocess.Popen(
                self.command,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                start_new_session=True,
                # Not orphaned if the task's process is killed: SIGKILL, as torchrun's SIGTERM shutdown can
                # outlive the ranks by half a minute (seen in CI: the ranks gone, the agent still in its
                # `_close` 30 s after); each rank dies with the agent by its own parent-death signal.
                preexec_fn=die_with_parent(signal.SIGKILL),
            )
        write_pid_file(self.pid_file, self.process.pid, command=self.command)
        return self.process

    def stop(self) -> None:
        if self.process is None:
            return
        stop_server(self.pid_file, STOP_GRACE_S, GPU_RELEASE_S)  # also removes the pid file
        self.process.wait()
        self.process = None


def relay(progress_tail: LogTail, events_tail: LogTail, progress: ProgressCallback, log_line: LogCallback) -> None:
    """Hand rank 0's new progress updates to `progress` and the run's new events to `log_line`."""
    for event in parsed_lines("\n".join(events_tail.read_lines())):
        log_line(f"[{event['phase']}] {event['message']}")
    for line in progress_tail.read_lines():
        progress(ProgressUpdate.model_validate_json(line))


def follow(
    process: subprocess.Popen[bytes],
    progress_tail: LogTail,
    events_tail: LogTail,
    progress: ProgressCallback,
    log_line: LogCallback,
) -> int:
    """Relay until the agent exits; its return code."""
    while True:
        returncode = process.poll()
        relay(progress_tail, events_tail, progress, log_line)
        if returncode is not None:
            return returncode
        time.sleep(POLL_S)


def fresh_logs(launch_dir: Path) -> Path:
    """An empty `logs/` for this launch; the one before is kept as `logs.previous/`."""
    logs, previous = launch_dir / LOGS_DIR, launch_dir / PREVIOUS_LOGS_DIR
    if logs.exists():
        shutil.rmtree(previous, ignore_errors=True)
        logs.replace(previous)
    logs.mkdir(parents=True)
    return logs


def rank_env(launch_dir: Path) -> dict[str, str]:
    """The agent's (and so the ranks') environment: this process's, the launch folder, and `OMP_NUM_THREADS`
    1 unless set. torchrun itself sets 1 only for more than one process a node, so a node of one process
    would train on every core, and a CPU's matmul split over another thread count rounds differently: a
    2-node training of one process each would end with another loss than one node of two (10.2550001 vs
    10.2550097 in the test). The same thread count whatever the nodes makes them equal bit for bit."""
    return {**os.environ, LAUNCH_ENV: str(launch_dir), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}


def launch_training(
    config: PipelineConfig,
    hidden_states: HiddenStateSet,
    vocab_map: VocabMap,
    target: TargetModel,
    processes: int,
    events: RunEvents,
    progress: ProgressCallback = ignore_progress,
    log_line: LogCallback = log.info,
) -> DraftCheckpoint:
    """Train in `processes` ranks under torchrun (see the module docstring) and return the checkpoint."""
    layout = RunLayout.of(config)
    cfg, upstream = phase_config(config, training_world(config)), upstream_of(hidden_states, vocab_map, target)
    if (cached := reused_checkpoint(layout.draft.root, cfg, upstream, events)) is not None:
        return cached
    launch_dir = layout.sliced(layout.draft.launch)  # a node's own, when training spans hosts
    launch_dir.mkdir(parents=True, exist_ok=True)
    logs = fresh_logs(launch_dir)
    config_file = launch_dir / CONFIG_FILE
    write_text_atomic(config_file, dump_config(config))
    (launch_dir / PROGRESS_FILE).unlink(missing_ok=True)
    worker = worker_command(eagle3_script(), config_file, hidden_states.root_path, vocab_map.root_path)
    rendezvous = Rendezvous.of(config)
    command = torchrun_command(processes, logs, worker, rendezvous)
    where = "" if rendezvous is None else f" on node {rendezvous.node} of {rendezvous.nodes} ({rendezvous.endpoint})"
    events.record(
        PHASE,
        DECISION,
        f"training in {processes} processes{where} under torchrun (training.processes={config.training.processes}); "
        f"rank logs in {logs}",
        processes=processes,
        command=command,
    )
    events_tail = LogTail(events.path, offset=events.path.stat().st_size)  # what the ranks add from now on
    launch = TorchrunLaunch(command, rank_env(launch_dir), logs / AGENT_LOG, layout.pid_file(PHASE))
    try:
        returncode = follow(launch.start(), LogTail(launch_dir / PROGRESS_FILE), events_tail, progress, log_line)
    finally:
        launch.stop()
    if returncode != 0:
        raise launch_failure(returncode, logs)
    return launched_checkpoint(config, hidden_states, vocab_map, target)


def launched_checkpoint(
    config: PipelineConfig, hidden_states: HiddenStateSet, vocab_map: VocabMap, target: TargetModel
) -> DraftCheckpoint:
    """The checkpoint a launch that ended well left in `<run_dir>/draft`; `RankFailed` unless it records
    these inputs and settings."""
    root = RunLayout.of(config).draft.root
    world = training_world(config)
    checkpoint = cached_checkpoint(root, phase_config(config, world), upstream_of(hidden_states, vocab_map, target))
    if checkpoint is None:
        raise RankFailed(f"torchrun ended well, yet {root} holds no checkpoint of the task's inputs and settings")
    return checkpoint


def training_world(config: PipelineConfig) -> int:
    """The processes that train, on every host together: `training.processes` as this host resolves it, times
    the hosts of a training spread over hosts (each a node of as many)."""
    tc = config.training
    return resolve_processes(tc.processes, tc.device, visible_gpus()) * config.orchestration.hosts


def train_draft_on_host(
    config: PipelineConfig,
    hidden_states: HiddenStateSet,
    vocab_map: VocabMap,
    target: TargetModel,
    events: RunEvents,
    progress: ProgressCallback = ignore_progress,
    log_line: LogCallback = log.info,
) -> DraftCheckpoint:
    """`train_draft` in `training.processes` processes: in this process for one, under torchrun for more or
    when this host is a node of a training over hosts (`orchestration.host`)."""
    tc = config.training
    processes = resolve_processes(tc.processes, tc.device, visible_gpus())
    if processes == 1 and host_slice(config) is None:
        return train_draft(config, hidden_states, vocab_map, target, events, progress)
    return launch_training(config, hidden_states, vocab_map, target, processes, events, progress, log_line)
