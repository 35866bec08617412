import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from eagle3_core.artifacts import TargetModel
from eagle3_core.config import TargetConfig
from eagle3_core.events import WEIGHT_LOAD, RunEvents
from eagle3_core.target.models import check_layer_ids, default_aux_layer_ids, load_target_tensors
from eagle3_core.target.prepare import converted_target


@pytest.mark.parametrize(("layers", "ids"), [(30, [2, 15, 27]), (61, [2, 30, 58]), (32, [2, 16, 29])])
def test_default_aux_layer_ids(layers, ids):
    assert default_aux_layer_ids(layers) == ids
    check_layer_ids(ids, layers)


def test_layer_ids_that_do_not_fit_are_refused():
    with pytest.raises(ValueError, match="do not fit"):
        check_layer_ids([2, 15, 30], 30)
    with pytest.raises(ValueError, match="ascending"):
        check_layer_ids([15, 2, 27], 30)
    with pytest.raises(ValueError, match="at least 6"):
        default_aux_layer_ids(4)


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_deepseek"])
def test_load_target_tensors_equals_full_model(fixture, request):
    target = request.getfixturevalue(fixture)
    model = AutoModelForCausalLM.from_pretrained(target.root_path, dtype=torch.float32)
    tensors = load_target_tensors(target.root_path, ["embed_tokens", "norm", "lm_head"])
    assert torch.equal(tensors["embed_tokens"], model.get_input_embeddings().weight)
    assert torch.equal(tensors["norm"], model.model.norm.weight)
    assert torch.equal(tensors["lm_head"], model.get_output_embeddings().weight)
    assert target.tie_word_embeddings == (fixture == "tiny_llama")


def test_load_target_tensors_reads_sharded_index(tiny_llama, tmp_path):
    """A multi-file checkpoint is read through its index, touching only the files that hold the tensors."""
    from safetensors.torch import load_file, save_file

    full = load_file(tiny_llama.root_path / "model.safetensors")
    names = sorted(full)
    halves = {"a.safetensors": names[: len(names) // 2], "b.safetensors": names[len(names) // 2 :]}
    weight_map = {}
    for file, part in halves.items():
        save_file({n: full[n] for n in part}, tmp_path / file)
        weight_map.update(dict.fromkeys(part, file))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (tmp_path / "config.json").write_text((tiny_llama.root_path / "config.json").read_text())
    tensors = load_target_tensors(tmp_path, ["norm", "lm_head"])
    assert torch.equal(tensors["norm"], full["model.norm.weight"])
    assert torch.equal(tensors["lm_head"], full["model.embed_tokens.weight"])


def test_untied_target_without_lm_head_is_an_error(tiny_llama, tmp_path):
    from safetensors.torch import load_file, save_file

    full = load_file(tiny_llama.root_path / "model.safetensors")
    save_file(full, tmp_path / "model.safetensors")
    config = json.loads((tiny_llama.root_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
    with pytest.raises(KeyError, match="lm_head"):
        load_target_tensors(tmp_path, ["lm_head"])


def test_events_count_weight_loads(tmp_path):
    events = RunEvents(tmp_path)
    with events.weight_load("extraction", "target"):
        pass
    events.record("extraction", "resume", "resuming at shard 3 of 8", shard=3)
    assert events.count(WEIGHT_LOAD) == 1
    assert events.count(WEIGHT_LOAD, phase="sampling") == 0
    assert [e["event"] for e in events.read()] == ["weight_load", "resume"]


def test_a_converted_target_whose_manifest_predates_the_text_config_is_described_not_converted(
    tmp_path, smollm2_target
):
    """A cached conversion whose manifest has no `text` (written before it was recorded) is described again
    with the same digest, without a new conversion, and its manifest file is left as older code wrote it."""
    out_dir = tmp_path / "converted"
    out_dir.mkdir()
    for file in smollm2_target.root_path.iterdir():
        (out_dir / file.name).symlink_to(file)  # the weights are only stat'ed
    older = json.loads(smollm2_target.model_dump_json(exclude={"text", "digest"}))
    manifest = out_dir / f"{TargetModel.kind}.json"
    manifest.unlink()
    manifest.write_text(json.dumps({**older, "root": str(out_dir)}))
    events = RunEvents(tmp_path)
    source = smollm2_target.source.removeprefix("gguf:")
    target = converted_target(TargetConfig(), Path("unused.gguf"), source, out_dir, events)
    assert target.text == smollm2_target.text and target.digest == smollm2_target.digest
    assert events.count(WEIGHT_LOAD) == 0 and "text" not in json.loads(manifest.read_text())
