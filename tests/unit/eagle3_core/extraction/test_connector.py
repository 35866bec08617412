"""The connector without an engine (vLLM's own scheduler- and worker-side code on a connector built by hand):
only requests that ask get a file and hold their blocks (the shared server's sampling requests write nothing);
the scheduler names the fp8 requests to the worker, and the worker's fp8 file, read back by the vLLM backend,
makes the very shard the host's own quantisation makes."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import torch
from vllm import SamplingParams
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnectorMetadata,
    PendingSave,
    extract_from_kv_cache,
)

from eagle3_core.extraction.connector import (
    SCALES,
    STATES,
    HiddenStatesConnector,
    extract_request,
    slot_mapping,
    wants_fp8,
    wants_hidden_states,
)
from eagle3_core.extraction.vllm_backend import read_states_file, sample_states
from eagle3_core.hidden_states.storage import FP8, write_shard

# vLLM 0.26 caches the states as [blocks, block, L, H], 0.32 as [blocks, L, block, H]: with a block of 4
# tokens and L = 4 (3 aux + last) one cache reads right under either version's `extract_from_kv_cache`.
BLOCK, BLOCKS, LAYERS, HIDDEN = 4, 6, 4, 32
EXTRACT_REQUEST = extract_request("bf16")


def new_request(req_id: str, kv_transfer_params: dict | None) -> SimpleNamespace:
    extra_args = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params is not None else None
    return SimpleNamespace(req_id=req_id, sampling_params=SamplingParams(max_tokens=1, extra_args=extra_args))


def connector(storage: Path, kv_cache: torch.Tensor | None = None) -> HiddenStatesConnector:
    """Both sides' state, without an engine: the scheduler's file names and the worker's CPU cache."""
    made = object.__new__(HiddenStatesConnector)
    made._pending_saves, made._request_filenames = {}, {}
    made._storage_path, made.allow_custom_save_path = str(storage), False
    made._given_files, made._fp8_requests = set(), set()
    made._kv_cache, made._block_size, made._is_tp_rank_zero = kv_cache, BLOCK, True
    made._lock_fds, made.use_lock = {}, True
    made._executor = ThreadPoolExecutor(max_workers=1)
    made._req_copy_events, made._req_futures = {}, {}
    return made


def test_only_requests_that_ask_get_a_file_and_hold_their_blocks(tmp_path: Path):
    made = connector(tmp_path)
    requests = [new_request("extract", EXTRACT_REQUEST), new_request("sample", None), new_request("other", {})]
    meta = made.build_connector_meta(SimpleNamespace(scheduled_new_reqs=requests))
    assert list(meta.new_req_filenames) == ["extract"]

    def finished(req_id: str, params: dict | None):
        request = SimpleNamespace(request_id=req_id, kv_transfer_params=params, prompt_token_ids=[1, 2, 3])
        return made.request_finished(request, block_ids=[0])

    delay, params = finished("extract", EXTRACT_REQUEST)
    assert delay and params == {"hidden_states_path": str(tmp_path / "extract.safetensors")}
    assert finished("sample", None) == (False, None), "a sampling request frees its blocks and writes nothing"
    assert finished("other", {}) == (False, None)
    pending = made.build_connector_meta(SimpleNamespace(scheduled_new_reqs=[])).pending_saves
    assert [p.req_id for p in pending] == ["extract"]


def test_the_marker_is_read_from_the_kv_transfer_params_the_server_copies_into_extra_args():
    assert wants_hidden_states({"kv_transfer_params": EXTRACT_REQUEST})
    assert not wants_hidden_states(None)
    assert not wants_hidden_states({"kv_transfer_params": None})
    assert not wants_hidden_states({"kv_transfer_params": {"eagle3_extract": False}})
    assert not wants_hidden_states(EXTRACT_REQUEST), "the marker belongs inside kv_transfer_params"


def test_the_scheduler_names_the_fp8_requests_in_the_example_metadata(tmp_path: Path):
    made = connector(tmp_path)
    requests = [
        new_request("fp8", extract_request("fp8")),
        new_request("bf16", extract_request("bf16")),
        new_request("sample", None),
    ]
    meta = made.build_connector_meta(SimpleNamespace(scheduled_new_reqs=requests))
    assert isinstance(meta, ExampleHiddenStatesConnectorMetadata), "the example's worker code reads it"
    assert sorted(meta.new_req_filenames) == ["bf16", "fp8"] and meta.fp8_requests == {"fp8"}
    assert wants_fp8({"kv_transfer_params": extract_request("fp8")})
    assert not wants_fp8({"kv_transfer_params": extract_request("bf16")}) and not wants_fp8(None)


def test_an_fp8_file_makes_the_shard_the_host_quantisation_makes(tmp_path: Path):
    torch.manual_seed(0)
    kv_cache = torch.randn(BLOCKS, BLOCK, LAYERS, HIDDEN).to(torch.bfloat16) * 30  # the engine's cache
    tokens, blocks = 10, [4, 1, 3]
    made = connector(tmp_path, kv_cache)
    row = {"id": "s0", "loss_mask": [0] * 4 + [1] * 6}
    shards = {}
    for dtype in ("bf16", "fp8"):
        made._fp8_requests = {dtype} if dtype == "fp8" else set()
        filename = str(tmp_path / "incoming" / f"{dtype}.safetensors")
        token_ids = torch.arange(tokens)
        made._submit_async_write(PendingSave(req_id=dtype, filename=filename, token_ids=token_ids, block_ids=blocks))
        data = read_states_file(Path(filename))  # waits on the lock the write holds until it is done
        expected = extract_from_kv_cache(kv_cache, slot_mapping(blocks, BLOCK), tokens)  # [T, L, H]
        if dtype == "fp8":
            assert data[STATES].dtype == FP8 and data[SCALES].shape == (tokens, LAYERS)
            restored = data[STATES].float() * data[SCALES][..., None]
            assert torch.allclose(restored, expected.float(), rtol=0.07, atol=0), "e4m3: 3 mantissa bits"
        else:
            assert SCALES not in data and torch.equal(data[STATES], expected)
        states = sample_states(row, data)
        assert states.quantized == (dtype == "fp8") and torch.equal(states.input_ids, token_ids)
        shards[dtype] = (tmp_path / f"{dtype}.safetensors", states)
    written = {dtype: write_shard(path, [states], "fp8", {}) for dtype, (path, states) in shards.items()}
    assert written["fp8"] == written["bf16"], "quantised in the engine or on the host: the same shard"
    assert shards["fp8"][0].read_bytes() == shards["bf16"][0].read_bytes()
