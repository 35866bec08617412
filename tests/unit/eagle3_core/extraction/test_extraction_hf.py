"""The hf backend through the phase function, on tiny random targets (Llama and DeepSeek-V3/MLA/MoE):
layer ids checked against an independent computation, shard resume, damage repair, held-out rows."""

from __future__ import annotations

import json
import os

import pytest
import torch
from transformers import AutoModelForCausalLM

from eagle3_core.artifacts import ArtifactInvalid
from eagle3_core.config import PipelineConfig
from eagle3_core.events import CACHE_HIT, RESUME, WEIGHT_LOAD, RunEvents
from eagle3_core.extraction.hf_backend import HfBackend
from eagle3_core.extraction.merge import merge_slices
from eagle3_core.extraction.phase import extract_hidden_states
from eagle3_core.hidden_states.reader import HiddenStateDataset
from eagle3_core.hidden_states.storage import FP8_MAX_RELATIVE_ERROR
from eagle3_core.sampling.table import is_heldout, iter_rows
from tests.helpers.extraction_fixtures import build_sample_set


@pytest.fixture(scope="module")
def sample_set(tmp_path_factory, smollm2_target):
    return build_sample_set(tmp_path_factory.mktemp("samples"), smollm2_target.root_path, num_ok=8)


def make_config(run_dir, **extraction) -> PipelineConfig:
    config = PipelineConfig(run_dir=run_dir)
    config.sampling.holdout_fraction = 0.0
    config.extraction.backend = "hf"
    config.extraction.samples_per_shard = 3
    config.extraction.batch_size = 2
    config.extraction.compute_dtype = "bfloat16"  # the dtype of the independent computation below
    for name, value in extraction.items():
        setattr(config.extraction, name, value)
    return config


def states_after(model_dir, num_layers: int, input_ids: list[int]) -> torch.Tensor:
    """Independent reference: a copy of the target cut to its first `num_layers` decoder layers; the input
    of its final norm is the state after exactly `num_layers` layers. [T, H]"""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    decoder = model.get_decoder()
    decoder.layers = decoder.layers[:num_layers]
    captured = []
    decoder.norm.register_forward_pre_hook(lambda _m, args: captured.append(args[0]))
    with torch.inference_mode():
        decoder(input_ids=torch.tensor([input_ids]), use_cache=False)
    return captured[0][0].float()


def cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=-1)


@pytest.mark.parametrize("target_name", ["tiny_llama", "tiny_deepseek"])
def test_stored_states_match_an_independent_computation(request, tmp_path, sample_set, target_name):
    target = request.getfixturevalue(target_name)
    hidden = extract_hidden_states(make_config(tmp_path), sample_set, target, RunEvents(tmp_path))
    assert hidden.layer_ids == [2, 4, 5] and hidden.samples == 8 and not hidden.last_state_normed
    ds = HiddenStateDataset(hidden, max_length=4096, sample_ids=["p0002"])
    item = ds[0]
    row = next(r for r in iter_rows(sample_set) if r["id"] == "p0002")
    assert item["input_ids"].tolist() == row["input_ids"]
    assert item["loss_mask"].tolist() == [bool(m) for m in row["loss_mask"]]
    for slot, layer_id in enumerate(hidden.layer_ids):
        reference = states_after(target.root_path, layer_id, row["input_ids"])
        assert cosine(item["aux"][:, slot], reference).min() > 0.999, layer_id
    last = states_after(target.root_path, target.num_layers, row["input_ids"])
    assert cosine(item["last"], last).min() > 0.999
    # The comparison can fail: the state one layer later is measurably different.
    off_by_one = states_after(target.root_path, hidden.layer_ids[0] + 1, row["input_ids"])
    assert cosine(item["aux"][:, 0], off_by_one).mean() < 0.99


def test_only_ok_non_heldout_rows_are_extracted_and_the_hold_out_is_by_prompt(tmp_path, smollm2_target, tiny_llama):
    """Two responses per prompt: a held-out prompt has neither extracted; the index names each sample's prompt
    (the training validation split is by prompt), past a prompt's first response only."""
    sample_set = build_sample_set(tmp_path / "samples", smollm2_target.root_path, num_ok=8, responses=2)
    config = make_config(tmp_path)
    config.sampling.holdout_fraction = 0.3
    hidden = extract_hidden_states(config, sample_set, tiny_llama, RunEvents(tmp_path))
    ds = HiddenStateDataset(hidden, max_length=64)
    heldout = {f"p{i:04d}" for i in range(4) if is_heldout(f"p{i:04d}", 0.3)}
    assert heldout == {"p0003"}
    assert ds.sample_ids == ["p0000", "p0000#1", "p0001", "p0001#1", "p0002", "p0002#1"]
    assert ds.prompt_ids == ["p0000", "p0000", "p0001", "p0001", "p0002", "p0002"]
    index = json.loads(hidden.path_of("index.json").read_text())["samples"]
    assert [entry.get("prompt") for entry in index] == [None, "p0000", None, "p0001", None, "p0002"]


def test_a_failure_resumes_from_the_last_complete_shard_with_one_more_weight_load(
    tmp_path, sample_set, tiny_llama, monkeypatch
):
    config = make_config(tmp_path)
    events = RunEvents(tmp_path)
    real_extract = HfBackend.extract
    calls = []

    def fail_on_second_shard(self, rows):
        calls.append(len(rows))
        if len(calls) == 2:
            raise RuntimeError("injected failure")
        return real_extract(self, rows)

    monkeypatch.setattr(HfBackend, "extract", fail_on_second_shard)
    with pytest.raises(RuntimeError, match="injected failure"):
        extract_hidden_states(config, sample_set, tiny_llama, events)
    out = tmp_path / "hidden_states"
    first = out / "shard-00000.safetensors"
    assert first.exists() and not (out / "shard-00001.safetensors").exists()
    first_mtime = first.stat().st_mtime_ns
    assert events.count(WEIGHT_LOAD) == 1

    monkeypatch.setattr(HfBackend, "extract", real_extract)
    hidden = extract_hidden_states(config, sample_set, tiny_llama, events)
    assert events.count(WEIGHT_LOAD) == 2, "exactly one more weight load"
    assert first.stat().st_mtime_ns == first_mtime, "the completed shard was not rewritten"
    resume = [e for e in events.read() if e["event"] == RESUME]
    assert resume[-1]["pending"] == ["shard-00001.safetensors", "shard-00002.safetensors"]
    assert hidden.samples == 8 and len(HiddenStateDataset(hidden, 4096).sample_ids) == 8

    extract_hidden_states(config, sample_set, tiny_llama, events)
    assert events.count(CACHE_HIT) == 1 and events.count(WEIGHT_LOAD) == 2
    (out / "hidden_state_set.json").unlink()
    extract_hidden_states(config, sample_set, tiny_llama, events)
    assert events.count(WEIGHT_LOAD) == 2, "every shard done: no weights loaded"


@pytest.mark.parametrize("damage", ["truncate", "corrupt"])
def test_a_damaged_shard_is_detected_and_rewritten(tmp_path, sample_set, tiny_llama, damage):
    config = make_config(tmp_path)
    events = RunEvents(tmp_path)
    hidden = extract_hidden_states(config, sample_set, tiny_llama, events)
    shard = tmp_path / "hidden_states" / "shard-00001.safetensors"
    untouched = tmp_path / "hidden_states" / "shard-00000.safetensors"
    untouched_mtime = untouched.stat().st_mtime_ns
    data = bytearray(shard.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert not hidden.is_valid()

    repaired = extract_hidden_states(config, sample_set, tiny_llama, events)
    assert events.count(WEIGHT_LOAD) == 2
    resume = [e for e in events.read() if e["event"] == RESUME]
    assert resume[-1]["pending"] == ["shard-00001.safetensors"]
    assert untouched.stat().st_mtime_ns == untouched_mtime
    repaired.validate(deep=True)
    record = json.loads((tmp_path / "hidden_states" / "shard-00001.safetensors.done.json").read_text())
    assert record["file"]["bytes"] == os.path.getsize(shard)


def test_fp8_extraction_stays_within_the_stated_error_of_bf16(tmp_path, sample_set, tiny_llama):
    bf16 = extract_hidden_states(make_config(tmp_path / "bf16"), sample_set, tiny_llama, RunEvents(tmp_path))
    fp8 = extract_hidden_states(make_config(tmp_path / "fp8", dtype="fp8"), sample_set, tiny_llama, RunEvents(tmp_path))
    assert fp8.dtype == "fp8" and fp8.bytes_per_token < 0.6 * bf16.bytes_per_token
    for a, b in zip(HiddenStateDataset(bf16, 256), HiddenStateDataset(fp8, 256), strict=True):
        assert torch.equal(a["input_ids"], b["input_ids"])
        for name in ("aux", "last"):
            rel = (b[name] - a[name]).norm(dim=-1) / a[name].norm(dim=-1)
            assert rel.max() < FP8_MAX_RELATIVE_ERROR, (name, rel.max())


def test_new_samples_cost_only_the_shards_that_hold_them(tmp_path, smollm2_target, tiny_llama):
    """The nightly run adds prompts: the SampleSet digest changes, yet shards whose samples are unchanged
    are kept and only the new samples are extracted."""
    config, events = make_config(tmp_path), RunEvents(tmp_path)
    first = build_sample_set(tmp_path / "s6", smollm2_target.root_path, num_ok=6)
    extract_hidden_states(config, first, tiny_llama, events)
    out = tmp_path / "hidden_states"
    mtimes = [(out / f"shard-0000{i}.safetensors").stat().st_mtime_ns for i in range(2)]
    grown = build_sample_set(tmp_path / "s8", smollm2_target.root_path, num_ok=8)
    assert grown.digest != first.digest
    hidden = extract_hidden_states(config, grown, tiny_llama, events)
    assert [e["pending"] for e in events.read() if e["event"] == RESUME] == [["shard-00002.safetensors"]]
    assert [(out / f"shard-0000{i}.safetensors").stat().st_mtime_ns for i in range(2)] == mtimes
    assert hidden.samples == 8


def test_hosts_extract_their_slices_and_the_merge_equals_one_host(tmp_path, sample_set, tiny_llama):
    """Two hosts, each its slice of the samples in a folder of its own; merged, the same samples in the same
    order with the same states as one host's. A host lost mid-slice: its re-run redoes only its missing
    shard, and the merge names a slice that is not finished."""
    whole = extract_hidden_states(make_config(tmp_path / "one"), sample_set, tiny_llama, RunEvents(tmp_path))
    config = make_config(tmp_path / "two")
    config.orchestration.hosts = 2
    events = RunEvents(tmp_path / "two")
    hosts = [
        config.model_copy(update={"orchestration": config.orchestration.model_copy(update={"host": h})}) for h in (0, 1)
    ]
    for host in hosts:
        extract_hidden_states(host, sample_set, tiny_llama, events)
    merged = merge_slices(config, sample_set, tiny_llama, events)
    assert (merged.config, merged.upstream, merged.samples, merged.tokens) == (
        whole.config,
        whole.upstream,
        whole.samples,
        whole.tokens,
    )
    one, two = HiddenStateDataset(whole, 4096), HiddenStateDataset(merged, 4096)
    assert two.sample_ids == one.sample_ids
    for a, b in zip(one, two, strict=True):
        assert all(torch.equal(a[name], b[name]) for name in ("input_ids", "loss_mask", "aux", "last"))

    lost = tmp_path / "two" / "hidden_states" / "host-1-of-2"
    (lost / "hidden_state_set.json").unlink()
    (lost / "shard-00000.safetensors").unlink()
    kept = {p: p.stat().st_mtime_ns for p in lost.parent.rglob("shard-*.safetensors")}
    with pytest.raises(ArtifactInvalid, match="host 1 of 2 left no finished hidden states"):
        merge_slices(config, sample_set, tiny_llama, events)
    for host in hosts:
        extract_hidden_states(host, sample_set, tiny_llama, events)
    assert [e["pending"] for e in events.read() if e["event"] == RESUME] == [["shard-00000.safetensors"]]
    assert all(p.stat().st_mtime_ns == mtime for p, mtime in kept.items())
    merge_slices(config, sample_set, tiny_llama, events).validate(deep=True)
