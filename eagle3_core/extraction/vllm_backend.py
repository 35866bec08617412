"""The vLLM backend: prefill-only extraction with the `extract_hidden_states` speculative method.

vLLM is started with the aux layer ids plus N (the number of decoder layers): id N is the state after the
last decoder layer, before the final norm (vLLM's Llama and DeepSeek-V2/V3 models both return it for id N),
so the stored `last` matches the hf backend's. Each sample's token ids go to `/v1/completions` with
`max_tokens=1`; the KV connector (`connector.py`) writes the prompt's states to a safetensors file whose
path comes back in `kv_transfer_params`; the file is read, checked and deleted, its states go into our
shards. With `extraction.dtype: fp8` the requests ask the connector to quantise in the engine, so the file
already holds the shard's fp8 rows and scales. Tensor parallelism, memory share and the rest come from
`config.server`; the server lifecycle (load progress, stall detection, clean stop) is
`eagle3_core.serving.engine`'s. `shared_server` builds the one server sampling and extraction share when
`extraction.reuse_sampling_server` says so (`eagle3_core.serving.shared`). An engine that dies mid-shard
fails the shard with `EngineDied` (transient: the phase's retry starts a new engine and extracts only the
shards without a completion record); nothing of the failed shard is written.
"""

from __future__ import annotations

import json
import shutil
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Any, TypeVar

import httpx
import torch
from safetensors import SafetensorError

from eagle3_core.artifacts import TargetModel
from eagle3_core.config import PipelineConfig
from eagle3_core.events import DECISION, RunEvents
from eagle3_core.extraction.connector import CONNECTOR_NAME, SCALES, STATES, extract_request
from eagle3_core.hidden_states.layers import resolve_layer_ids
from eagle3_core.hidden_states.storage import SampleRow, SampleStates, ShardError
from eagle3_core.hosts import host_slice
from eagle3_core.phases import EXTRACTION
from eagle3_core.progress import ProgressCallback
from eagle3_core.run_layout import RunLayout
from eagle3_core.serving.engine import ENGINE_EXIT_WAIT_S, EngineDied, EngineExit
from eagle3_core.serving.shared import CONTEXT_MARGIN, SharedServer, conversation_tokens, running_server

PHASE = EXTRACTION.name
Submitted = TypeVar("Submitted")


class ServerAnswerError(ShardError):
    """The server answered a sample's request with an error status."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


class StatesFileError(ShardError):
    """The connector's file named in an answer is missing or unreadable."""


def engine_may_have_died(exc: BaseException) -> bool:
    """Failures a dying engine causes: a lost connection, a 5xx answer while it shuts down, or an answered
    request whose file its killed worker never finished (the file's lock dies with the worker)."""
    return isinstance(exc, httpx.TransportError | StatesFileError) or (
        isinstance(exc, ServerAnswerError) and exc.status >= 500
    )


def server_layer_ids(layer_ids: list[int], num_layers: int) -> list[int]:
    """The ids vLLM is asked for: the three aux ids, then N for the pre-norm last state."""
    return [*layer_ids, num_layers]


def extraction_args(layer_ids: list[int], num_layers: int, storage_dir: Path) -> list[str]:
    """vLLM arguments that turn a server into a prefill-only hidden-state extractor."""
    speculative = {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {
            "hf_config": {"eagle_aux_hidden_state_layer_ids": server_layer_ids(layer_ids, num_layers)}
        },
    }
    transfer = {
        "kv_connector": CONNECTOR_NAME,
        "kv_connector_module_path": "eagle3_core.extraction.connector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": str(storage_dir)},
    }
    # Prefix caching would serve a shared prompt prefix from blocks computed for another request; every
    # request computes all of its own states instead, so nothing depends on cache reuse semantics.
    return [
        "--speculative-config", json.dumps(speculative),
        "--kv-transfer-config", json.dumps(transfer),
        "--no-enable-prefix-caching",
    ]  # fmt: skip


def sample_states(row: SampleRow, data: dict[str, torch.Tensor]) -> SampleStates:
    """One connector file's tensors as the sample's states: aux ids ascending, then N, with their fp8
    scales when the connector quantised them."""
    states = data[STATES]  # [T, 4, H]
    scale = data.get(SCALES)  # [T, 4] float32, fp8 files only
    return SampleStates(
        sample_id=row["id"],
        input_ids=data["token_ids"].long(),
        loss_mask=torch.tensor(row["loss_mask"], dtype=torch.int8),
        aux=states[:, :3],
        last=states[:, 3],
        aux_scale=None if scale is None else scale[:, :3],
        last_scale=None if scale is None else scale[:, 3],
    )


def read_states_file(path: Path) -> dict[str, torch.Tensor]:
    """Read a file the connector wrote (waiting on its lock until the write is complete), then delete it."""
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        cleanup_hidden_states,
        load_hidden_states,
    )

    data = load_hidden_states(str(path))
    cleanup_hidden_states(str(path))
    return data


def submitted_ahead(
    shards: Iterable[list[SampleRow]], submit: Callable[[list[SampleRow]], Submitted], rows_ahead: int
) -> Iterator[tuple[list[SampleRow], Submitted]]:
    """Submit the shards in order and hand out each one (its rows and what `submit` returned) only once
    `rows_ahead` rows of later shards are submitted too, or none are left: the work behind a shard keeps
    the engine busy while that shard is collected."""
    queued: deque[tuple[list[SampleRow], Submitted]] = deque()
    queued_rows = 0  # rows submitted and not yet handed out
    for rows in shards:
        queued.append((rows, submit(rows)))
        queued_rows += len(rows)
        while len(queued) > 1 and queued_rows - len(queued[0][0]) >= rows_ahead:
            head = queued.popleft()
            queued_rows -= len(head[0])
            yield head
    while queued:
        yield queued.popleft()


class VllmBackend:
    """Sends a shard's samples to a running extraction server, `concurrency` requests at a time, asking for
    the states as `dtype` (`extraction.dtype`)."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None,
        concurrency: int,
        timeout_s: float,
        engine_exit: EngineExit,
        dtype: str = "bf16",
    ):
        self.engine_exit = engine_exit
        self.transfer_params = extract_request(dtype)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(base_url=base_url, headers=headers, timeout=timeout_s)
        self.in_flight = concurrency
        self.pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="extract-request")
        models = self.client.get("/v1/models")
        models.raise_for_status()
        self.model = models.json()["data"][0]["id"]

    def extract_one(self, row: SampleRow) -> SampleStates:
        ids = list(row["input_ids"])
        body = {
            "model": self.model,
            "prompt": ids,
            "max_tokens": 1,
            "temperature": 0.0,
            "return_token_ids": True,
            "kv_transfer_params": self.transfer_params,
        }
        response = self.client.post("/v1/completions", json=body)
        if response.status_code != 200:
            raise ServerAnswerError(
                f"sample {row['id']}: server answered {response.status_code}: {response.text[:300]}",
                response.status_code,
            )
        answer = response.json()
        returned = answer["choices"][0].get("prompt_token_ids")
        if returned != ids:
            raise ShardError(f"sample {row['id']}: the server's prompt token ids differ from the SampleSet's")
        path = (answer.get("kv_transfer_params") or {}).get("hidden_states_path")
        if not path:
            raise ShardError(f"sample {row['id']}: no hidden_states_path in the answer; is the connector set?")
        try:
            data = read_states_file(Path(path))
        except (OSError, SafetensorError) as exc:
            raise StatesFileError(
                f"sample {row['id']}: the connector's file {path} is missing or unreadable: {exc}"
            ) from exc
        return sample_states(row, data)

    def submit(self, rows: list[SampleRow]) -> list[Future[SampleStates]]:
        return [self.pool.submit(self.extract_one, row) for row in rows]

    def collect(self, rows: list[SampleRow], futures: list[Future[SampleStates]]) -> list[SampleStates]:
        """The states of one shard's samples; `EngineDied` when the engine died meanwhile."""
        try:
            return [future.result() for future in futures]
        except Exception as exc:
            report = self.engine_exit(ENGINE_EXIT_WAIT_S if engine_may_have_died(exc) else 0)
            if report is None:
                raise
            raise EngineDied(f"extraction engine died mid-shard ({len(rows)} samples, none kept): {report}") from exc

    def extract(self, rows: list[SampleRow]) -> tuple[list[SampleStates], None]:
        """The states of one shard's samples."""
        return self.collect(rows, self.submit(rows)), None

    def extract_shards(self, shards: Iterable[list[SampleRow]]) -> Iterator[tuple[list[SampleStates], None]]:
        """Each shard's states, in order. Later shards' requests are sent before a shard is collected, as many
        as are in flight (`submitted_ahead`): the engine never drains at a shard boundary while the last
        requests of a shard finish. Beyond what the shard writer queues, host memory holds the states of the
        shard being collected and of the requests submitted behind it: fewer than `in_flight` plus one shard's
        samples (a shard is submitted whole)."""
        for rows, futures in submitted_ahead(shards, self.submit, self.in_flight):
            yield self.collect(rows, futures), None

    def close(self) -> None:
        """Stop the requests not yet sent (a failed shard leaves later shards' requests queued)."""
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.client.close()


@contextmanager
def open_vllm_backend(
    config: PipelineConfig,
    target: Any,
    layer_ids: list[int],
    events: RunEvents,
    progress: ProgressCallback,
    server: Any,
    max_tokens: int,
) -> Iterator[VllmBackend]:
    """Use `server` when given (it must run with `extraction_args`; a SharedServer is started or widened
    here when needed), else start one extraction server (one weight load) and stop it on exit.
    `max_tokens` is the longest sample: the server's context is widened to hold it plus the one
    generated token."""
    from eagle3_core.serving.engine import VllmServer, requests_in_flight

    timeout_s, dtype = config.sampling.request_timeout_s, config.extraction.dtype
    in_flight = requests_in_flight(config.server, config.extraction.concurrency)
    if server is not None:
        running = running_server(server, PHASE, progress, max_tokens + 1)
        backend = VllmBackend(running.base_url, running.api_key, in_flight, timeout_s, running.exit_report, dtype)
        try:
            yield backend
        finally:
            backend.close()
        return
    incoming = RunLayout.of(config).incoming_states
    shutil.rmtree(incoming, ignore_errors=True)
    incoming.mkdir(parents=True)
    server_config = config.server
    if max_tokens + 1 > server_config.max_model_len:
        server_config = server_config.model_copy(update={"max_model_len": max_tokens + 1})
        events.record(PHASE, DECISION, f"extraction server context widened to {max_tokens + 1} tokens "
                      "to hold the longest sample", max_model_len=max_tokens + 1)  # fmt: skip
    args = extraction_args(layer_ids, target.num_layers, incoming.resolve())
    part = host_slice(config)
    with VllmServer(server_config, target.root_path, config.run_dir, events, progress, args, PHASE, part) as running:
        backend = VllmBackend(running.base_url, running.api_key, in_flight, timeout_s, running.exit_report, dtype)
        try:
            yield backend
        except EngineDied as exc:
            events.record(PHASE, DECISION, f"aborted: {str(exc).splitlines()[0]}; shards written before are "
                          "kept, a re-run extracts the rest", reason=str(exc))  # fmt: skip
            raise
        finally:
            backend.close()
            shutil.rmtree(incoming, ignore_errors=True)


def shared_server(
    config: PipelineConfig,
    target: TargetModel,
    events: RunEvents,
    hold: Callable[[], AbstractContextManager[Any]] = nullcontext,
) -> SharedServer:
    """The server sampling and extraction share: an extraction server whose connector writes states only
    for requests that ask, with CONTEXT_MARGIN tokens of context beyond what a sampled conversation may hold
    (`conversation_tokens`), so that every one fits with its one generated token. Started on first use."""
    from eagle3_core.serving.engine import VllmServer

    incoming = RunLayout.of(config).incoming_states
    args = extraction_args(resolve_layer_ids(config, target), target.num_layers, incoming.resolve())
    part = host_slice(config)

    def launch(phase: str, progress: ProgressCallback, context: int) -> VllmServer:
        shutil.rmtree(incoming, ignore_errors=True)
        incoming.mkdir(parents=True)
        server_config = config.server.model_copy(update={"max_model_len": context})
        return VllmServer(server_config, target.root_path, config.run_dir, events, progress, args, phase, part).start()

    context = conversation_tokens(config.server.max_model_len, target.context_tokens) + CONTEXT_MARGIN
    return SharedServer(launch, context, events, hold)
