"""The exported folder: exactly the names and shapes vLLM loads, the aux ids in both places, and a
round trip through `load_exported`."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3_core.draft.export import check_checkpoint, checkpoint_tensors, export_draft, load_exported, sglang_ignores
from eagle3_core.draft.model import DraftKVCache, Eagle3Draft
from eagle3_core.evaluation.speculative import propose_chain
from tests.helpers.drafts import tiny_draft


def float_draft() -> Eagle3Draft:
    return tiny_draft().float()


def test_export_writes_vllm_layout(tmp_path) -> None:
    draft = float_draft()
    paths = export_draft(draft, tmp_path)
    assert sorted(p.name for p in paths) == ["config.json", "model.safetensors"]
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert config["draft_vocab_size"] == 40 and config["vocab_size"] == 97
    assert config["num_hidden_layers"] == 1
    tensors = load_file(tmp_path / "model.safetensors")
    assert "embed_tokens.weight" not in tensors
    assert not any(name.startswith("model.") for name in tensors)
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    assert tensors["lm_head.weight"].dtype == torch.bfloat16
    assert tensors["midlayer.self_attn.q_proj.weight"].shape == (32, 64)
    targets = torch.arange(40) + tensors["d2t"]
    assert torch.equal(torch.nonzero(tensors["t2d"]).flatten(), targets)


def test_export_refuses_missing_misnamed_or_misshaped_tensors() -> None:
    draft = float_draft()
    good = checkpoint_tensors(draft)
    missing = {k: v for k, v in good.items() if k != "midlayer.hidden_norm.weight"}
    with pytest.raises(ValueError, match="missing"):
        check_checkpoint(missing, draft.config)
    renamed = {("model." + k if k == "fc.weight" else k): v for k, v in good.items()}
    with pytest.raises(ValueError, match="unexpected"):
        check_checkpoint(renamed, draft.config)
    with pytest.raises(ValueError, match="shapes"):
        check_checkpoint({**good, "fc.weight": good["fc.weight"][:, :32]}, draft.config)
    with pytest.raises(ValueError, match="d2t"):
        check_checkpoint({**good, "d2t": good["d2t"] + 1000}, draft.config)


def test_load_exported_round_trip(tmp_path) -> None:
    draft = float_draft()
    export_draft(draft, tmp_path, dtype=torch.float32)
    weights = load_file(tmp_path / "model.safetensors")
    save_file({**weights, "embed_tokens.weight": draft.embed_tokens.weight.detach()}, tmp_path / "model.safetensors")
    loaded = load_exported(tmp_path)
    for name, tensor in draft.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    aux = torch.randn(5, 3, 32)
    ids = torch.randint(0, 97, (5,))
    assert torch.equal(
        propose_chain(draft, DraftKVCache(), aux, ids, 3)[0], propose_chain(loaded, DraftKVCache(), aux, ids, 3)[0]
    )


def test_load_exported_needs_embeddings(tmp_path) -> None:
    export_draft(float_draft(), tmp_path)
    with pytest.raises(ValueError, match="embed_tokens"):
        load_exported(tmp_path)


def test_sglang_ignores_the_flags_its_eagle3_layers_do_not_read() -> None:
    config = tiny_draft().config
    for flags, ignored in (
        (
            {"norm_before_fc": True, "norm_before_residual": True, "fc_norm": True},
            ["norm_before_fc", "norm_before_residual"],
        ),
        ({"norm_before_fc": False, "norm_before_residual": False, "fc_norm": True, "norm_output": True}, []),
    ):
        assert sglang_ignores(dataclasses.replace(config, **flags)) == ignored, flags
