"""The vLLM backend's server arguments and the connector's slot arithmetic (no server started)."""

from __future__ import annotations

import json

import torch

from eagle3_core.extraction.connector import CONNECTOR_NAME, CompletedCopy, HiddenStatesConnector, slot_mapping
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
