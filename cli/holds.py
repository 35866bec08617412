"""What a command holds until it ends: the run folder's writer lock (`eagle3_core.run_lock`) and the `gpu`
slot (`tasks.gpu_slot`). Each command's prologue (`cli.main.command`) opens `HELD`, and closes it, releasing
both, however the command ends."""

from __future__ import annotations

from contextlib import ExitStack
from contextvars import ContextVar
from pathlib import Path

from eagle3_core.config import PipelineConfig
from eagle3_core.events import RunEvents

HELD: ContextVar[ExitStack | None] = ContextVar("held", default=None)  # what the running command holds until it ends


def hold_run_dir(cfg: PipelineConfig, folder: Path | None = None) -> None:
    """Hold the run folder's writer lock (of this host's slice) until the command ends (`eagle3_core.run_lock`):
    a second writer of the same run folder is refused naming this one, and this one is refused while another
    writes. Taken before anything is written. `folder`: a folder under the run's of a writer that works beside
    its phases (`eagle3 serve`), which holds that folder's lock instead."""
    from eagle3_core.hosts import host_slice
    from eagle3_core.run_lock import run_dir_lock

    held = HELD.get()
    assert held is not None, "hold_run_dir is for a command's body"
    held.enter_context(run_dir_lock(folder or cfg.run_dir, host_slice(cfg)))


def hold_gpu_slot(cfg: PipelineConfig, events: RunEvents, phase: str) -> None:
    """Hold the `gpu` slot (`orchestration.gpu_limit`) until the command ends, as the flow's task of `phase`
    does: a phase command waits while a flow or another command uses the accelerator, saying whom it waits
    for. Where a Prefect server is set (PREFECT_API_URL: the slot its flows and workers share), or on a host
    with CUDA GPUs (a temporary Prefect server then, as `eagle3 run` starts); a CPU host without a Prefect
    server has no accelerator to share and starts none. Not inside a training launch: its task holds it."""
    import os

    from prefect.settings import get_current_settings

    from eagle3_core.preflight import visible_gpus
    from eagle3_core.training.launch import LAUNCH_ENV

    if LAUNCH_ENV in os.environ or not (get_current_settings().api.url or visible_gpus()):
        return
    from flows.temporary_server import own_temporary_server
    from tasks.gpu_slot import gpu_slot

    held = HELD.get()
    assert held is not None, "hold_gpu_slot is for a command's body"
    own_temporary_server(events)
    held.enter_context(gpu_slot(cfg.orchestration.gpu_limit, events, phase=phase))
