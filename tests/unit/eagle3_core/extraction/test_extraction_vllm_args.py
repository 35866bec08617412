"""The vLLM backend's server arguments and the connector's slot arithmetic (no server started)."""

from __future__ import annotations

import json

import torch

from eagle3_core.extraction.connector import (
    CONNECTOR_NAME,
    CompletedCopy,
    HiddenStatesConnector,
    HiddenStatesMetadata,
    slot_mapping,
)
from eagle3_core.extraction.vllm_backend import extraction_args, server_layer_ids


def test_the_server_is_asked_for_the_aux_ids_then_n_for_the_pre_norm_last_state(tmp_path):
    assert server_layer_ids([2, 15, 27], 30) == [2, 15, 27, 30]
    args = extraction_args([2, 15, 27], 30, tmp_path)
    speculative = json.loads(args[args.index("--speculative-config") + 1])
    assert speculative["method"] == "extract_hidden_states" and speculative["num_speculative_tokens"] == 1
    assert speculative["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27, 30]
    transfer = json.loads(args[args.index("--kv-transfer-config") + 1])
    assert transfer["kv_connector"] == CONNECTOR_NAME == HiddenStatesConnector.__name__
    assert transfer["kv_connector_module_path"] == HiddenStatesConnector.__module__
    assert transfer["kv_connector_extra_config"]["shared_storage_path"] == str(tmp_path)
    assert "--no-enable-prefix-caching" in args


def test_slot_mapping_lists_each_blocks_slots_in_token_order():
    assert slot_mapping([3, 0], 4).tolist() == [12, 13, 14, 15, 0, 1, 2, 3]
    assert slot_mapping([1], 2).dtype == torch.long


def test_a_synchronous_copy_reports_itself_done():
    copy = CompletedCopy()
    assert copy.query() is True
    copy.synchronize()


def vllm_026_request_finished(self, request, block_ids):
    """vLLM 0.26's example connector: it pops the request's file name without a default (0.27+ answers
    "nothing to save" for a request it has no name for)."""
    filename = self._request_filenames.pop(request.request_id)
    return True, {"hidden_states_path": filename}


def test_a_request_that_asked_for_no_states_finishes_on_vllm_026s_connector_too(monkeypatch):
    """On the H200 (vLLM 0.26) a sampling request on the shared extraction server killed the engine core
    (`KeyError` in `request_finished`): the example still named no file for it, as we asked."""
    from types import SimpleNamespace

    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        ExampleHiddenStatesConnector,
    )

    monkeypatch.setattr(ExampleHiddenStatesConnector, "request_finished", vllm_026_request_finished)
    connector = object.__new__(HiddenStatesConnector)
    connector._request_filenames = {"extract-1": "/states/extract-1.safetensors"}
    assert connector.request_finished(SimpleNamespace(request_id="sample-1"), [0, 1]) == (False, None)
    saved = connector.request_finished(SimpleNamespace(request_id="extract-1"), [2])
    assert saved == (True, {"hidden_states_path": "/states/extract-1.safetensors"})
    assert connector._request_filenames == {}


def vllm_026_get_finished(self, finished_req_ids):
    """vLLM 0.26's example connector: every finished request whose copy is done is reported as sent, also one
    it made no copy for (0.32 reports only those it has a copy event for)."""
    self._accumulated_finished_req_ids.update(finished_req_ids)
    done = set()
    for req_id in list(self._accumulated_finished_req_ids):
        event = self._req_copy_events.get(req_id)
        if event is not None and not event.query():
            continue
        self._req_copy_events.pop(req_id, None)
        self._accumulated_finished_req_ids.discard(req_id)
        done.add(req_id)
    return done or None, None


def test_a_request_that_asked_for_no_states_is_never_reported_sent_on_vllm_026s_connector(monkeypatch):
    """On the H200 (vLLM 0.26), after the fix above, the engine core still died on such a request: 0.26's
    worker reported it as sent, and the scheduler, which had freed it, asserted it still held it."""
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        ExampleHiddenStatesConnector,
    )

    monkeypatch.setattr(ExampleHiddenStatesConnector, "get_finished", vllm_026_get_finished)
    connector = object.__new__(HiddenStatesConnector)
    connector._given_files, connector._accumulated_finished_req_ids = set(), set()
    connector._req_copy_events, connector._fp8_requests = {}, set()
    meta = HiddenStatesMetadata()  # what our scheduler side sends
    meta.new_req_filenames["extract-1"] = "/states/extract-1.safetensors"  # sample-1 asked for none
    connector._connector_metadata = meta
    assert connector.get_finished(set()) == (None, None)  # the step that scheduled both
    connector._req_copy_events["extract-1"] = CompletedCopy()
    assert connector.get_finished({"sample-1", "extract-1"}) == ({"extract-1"}, None)
    assert connector._given_files == set() and connector._accumulated_finished_req_ids == set()
