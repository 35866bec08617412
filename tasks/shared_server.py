"""The vLLM server sampling and extraction share when `extraction.reuse_sampling_server` resolves to reuse
(`eagle3_core.sampling.reuse_decision`). The flow opens it around the two tasks and hands it to both; it starts on
first use holding the `gpu` slot, and stops (releasing the slot) when the block ends, on success or
failure. See `eagle3_core.serving.shared` for its lifetime."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial

from eagle3_core.artifacts import TargetModel
from eagle3_core.config import PipelineConfig
from eagle3_core.events import RunEvents
from eagle3_core.sampling.reuse_decision import resolve_reuse
from eagle3_core.serving.shared import SharedServer
from tasks.gpu_slot import gpu_slot


@contextmanager
def sampling_and_extraction_server(config: PipelineConfig, target: TargetModel) -> Iterator[SharedServer | None]:
    """The shared server (not started yet), or None when each phase starts its own engine."""
    events = RunEvents(config.run_dir)
    if not resolve_reuse(config, target, events):
        yield None
        return
    from eagle3_core.extraction.vllm_backend import shared_server

    server = shared_server(config, target, events, hold=partial(gpu_slot, config.orchestration.gpu_limit, events))
    try:
        yield server
    finally:
        server.stop()
