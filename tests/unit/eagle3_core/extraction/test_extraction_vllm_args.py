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
