from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from eagle3_core.config import TargetConfig
from eagle3_core.events import CACHE_HIT, WEIGHT_LOAD, RunEvents
from eagle3_core.target.models import load_target_tensors
from eagle3_core.target.prepare import prepare_target

pytestmark = pytest.mark.slow


def test_converted_smollm2_answers_paris(smollm2_target):
    assert smollm2_target.num_layers == 30 and smollm2_target.vocab_size == 49152
    tokenizer = AutoTokenizer.from_pretrained(smollm2_target.root_path)
    model = AutoModelForCausalLM.from_pretrained(smollm2_target.root_path, dtype=torch.float32)
    assert model.config.to_dict().get("quantization_config") is None
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")["input_ids"]
    out = model.generate(ids, max_new_tokens=20, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, ids.shape[1] :])
    tensors = load_target_tensors(smollm2_target.root_path, ["embed_tokens", "norm", "lm_head"])
    assert torch.equal(tensors["norm"].float(), model.model.norm.weight)
    assert torch.equal(tensors["lm_head"].float(), model.lm_head.weight)


def test_second_prepare_is_a_cache_hit(smollm2_target, tmp_path):
    events = RunEvents(tmp_path)
    again = prepare_target(TargetConfig(), events)
    assert again.digest == smollm2_target.digest
    assert events.count(CACHE_HIT) == 1 and events.count(WEIGHT_LOAD) == 0


def test_two_runs_at_once_convert_once_and_a_corrupt_conversion_is_redone(tmp_path):
    """Two runs on a fresh machine prepare the target at the same moment: one converts, the other waits for
    it and finds the folder (a cache hit), neither deletes the other's files. A corrupted folder is converted
    again."""
    cache = tmp_path / "cache"
    events = RunEvents(tmp_path)
    with ThreadPoolExecutor(2) as pool:
        first, other = pool.map(lambda _: prepare_target(TargetConfig(cache_dir=cache), events), range(2))
    assert first.digest == other.digest
    assert events.count(WEIGHT_LOAD) == 1 and events.count(CACHE_HIT) == 1
    first.validate(deep=True)
    (first.root_path / "config.json").write_text("{}")
    second = prepare_target(TargetConfig(cache_dir=cache), events)
    second.validate(deep=True)
    assert second.digest == first.digest
    assert events.count(WEIGHT_LOAD) == 2


def test_local_folder_is_used_in_place(smollm2_target, tmp_path):
    events = RunEvents(tmp_path)
    local = prepare_target(TargetConfig(model=str(smollm2_target.root_path)), events)
    assert local.root_path == smollm2_target.root_path
    assert local.config_digest == smollm2_target.config_digest
    assert local.tokenizer_digest == smollm2_target.tokenizer_digest
    assert events.count(WEIGHT_LOAD) == 0
    with pytest.raises(FileNotFoundError, match="neither an embedded target"):
        prepare_target(TargetConfig(model=str(tmp_path / "nope")), events)
