"""Shard format: round trip, validation of what a backend hands in, fp8 error bound, background writer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from eagle3_core.files import sha256_file
from eagle3_core.hidden_states.storage import (
    FP8_MAX_RELATIVE_ERROR,
    BackgroundShardWriter,
    SampleStates,
    ShardError,
    bytes_per_token,
    check_sample,
    dequantize_fp8,
    quantize_fp8,
    read_sample,
    read_shard_metadata,
    write_shard,
)

H = 32


def sample(sample_id: str, tokens: int, seed: int) -> SampleStates:
    gen = torch.Generator().manual_seed(seed)
    aux = torch.randn(tokens, 3, H, generator=gen)
    aux[:, :, 0] *= 50  # a massive-activation channel, as real hidden states have
    return SampleStates(
        sample_id=sample_id,
        input_ids=torch.randint(0, 1000, (tokens,), generator=gen),
        loss_mask=(torch.arange(tokens) >= tokens // 2).to(torch.int8),
        aux=aux,
        last=torch.randn(tokens, H, generator=gen),
    )


def shard_sample_ids(path: Path) -> list[str]:
    """The sample ids a shard's metadata lists, in order."""
    return json.loads(read_shard_metadata(path)["sample_ids"])


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_shard_round_trip_keeps_every_sample(tmp_path, dtype):
    samples = [sample("a", 5, 0), sample("b", 9, 1), sample("c", 1, 2)]
    path = tmp_path / "shard-00000.safetensors"
    assert write_shard(path, samples, dtype, {"plan_key": "k"}) == sha256_file(path)
    assert shard_sample_ids(path) == ["a", "b", "c"]
    tolerance = 1e-2 if dtype == "bf16" else FP8_MAX_RELATIVE_ERROR
    with safe_open(str(path), framework="pt") as f:
        offsets = f.get_tensor("offsets")
        assert offsets.tolist() == [0, 5, 14, 15]
        for i, s in enumerate(samples):
            got = read_sample(f, offsets, i)
            assert torch.equal(got["input_ids"], s.input_ids)
            assert torch.equal(got["loss_mask"], s.loss_mask.bool())
            for name in ("aux", "last"):
                err = (got[name] - getattr(s, name)).norm(dim=-1) / getattr(s, name).norm(dim=-1)
                assert err.max() < tolerance, (name, err.max())
    assert not list(tmp_path.glob(".*tmp*")), "no temporary file left behind"


def test_fp8_stays_within_stated_error_of_bf16_and_halves_the_disk(tmp_path):
    """fp8 e4m3 with per-row scales: relative L2 error per row < FP8_MAX_RELATIVE_ERROR, cosine > 0.999."""
    states = sample("a", 256, 3).aux.to(torch.bfloat16).float()  # [T, 3, H]
    q, scale = quantize_fp8(states)
    back = dequantize_fp8(q, scale)
    rel = (back - states).norm(dim=-1) / states.norm(dim=-1)
    assert rel.max() < FP8_MAX_RELATIVE_ERROR
    assert torch.nn.functional.cosine_similarity(back, states, dim=-1).min() > 0.999
    bf16, fp8 = tmp_path / "bf16.safetensors", tmp_path / "fp8.safetensors"
    write_shard(bf16, [sample("a", 256, 3)], "bf16", {})
    write_shard(fp8, [sample("a", 256, 3)], "fp8", {})
    assert fp8.stat().st_size < 0.6 * bf16.stat().st_size
    assert bytes_per_token(4096, "fp8") < 0.51 * bytes_per_token(4096, "bf16")


def test_check_sample_refuses_wrong_ids_shapes_and_nan():
    good = sample("a", 6, 0)
    check_sample(good, good.input_ids.tolist(), H)
    with pytest.raises(ShardError, match="token ids differ"):
        check_sample(good, [*good.input_ids.tolist()[:-1], 7777], H)
    with pytest.raises(ShardError, match="aux shape"):
        check_sample(good, good.input_ids.tolist(), H + 1)
    good.last[3, 4] = float("nan")
    with pytest.raises(ShardError, match="NaN or Inf"):
        check_sample(good, good.input_ids.tolist(), H)


def test_background_writer_surfaces_a_failed_check_and_writes_nothing_for_it(tmp_path):
    def refuse(samples):
        raise ShardError("bad sample")

    writer = BackgroundShardWriter()
    writer.submit(tmp_path / "ok.safetensors", [sample("a", 3, 0)], "bf16", {})
    writer.submit(tmp_path / "bad.safetensors", [sample("b", 3, 1)], "bf16", {}, check=refuse)
    with pytest.raises(RuntimeError, match="bad sample"):
        writer.close()
    assert (tmp_path / "ok.safetensors").exists()
    assert not (tmp_path / "bad.safetensors").exists()


def test_states_quantised_by_the_backend_are_stored_as_they_are(tmp_path):
    source = sample("a", 7, 4)
    aux_q, aux_s = quantize_fp8(source.aux)
    last_q, last_s = quantize_fp8(source.last)
    pre = SampleStates("a", source.input_ids, source.loss_mask, aux_q, last_q, aux_scale=aux_s, last_scale=last_s)
    written, reference = tmp_path / "pre.safetensors", tmp_path / "ref.safetensors"
    write_shard(written, [pre], "fp8", {})
    write_shard(reference, [source], "fp8", {})
    with safe_open(str(written), framework="pt") as f, safe_open(str(reference), framework="pt") as g:
        for name in ("aux", "aux_scale", "last", "last_scale"):
            assert torch.equal(f.get_tensor(name).float(), g.get_tensor(name).float()), name


def test_nan_is_caught_through_fp8_scales_and_backend_flags():
    source = sample("a", 5, 5)
    source.aux[2, 1, 3] = float("nan")
    aux_q, aux_s = quantize_fp8(source.aux)
    last_q, last_s = quantize_fp8(source.last)
    quantised = SampleStates("a", source.input_ids, source.loss_mask, aux_q, last_q, aux_s, last_s)
    with pytest.raises(ShardError, match="NaN or Inf"):
        check_sample(quantised, source.input_ids, H)
    flagged = sample("b", 5, 6)
    flagged.finite = torch.tensor([True, True, False, True, True])
    with pytest.raises(ShardError, match="NaN or Inf"):
        check_sample(flagged, flagged.input_ids, H)


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_a_shard_is_the_concatenation_safetensors_itself_reads(tmp_path, dtype):
    """The shard is streamed sample by sample: safetensors' own loader must find every tensor equal to the
    samples' rows concatenated, odd lengths (unaligned int8 and int64 boundaries) included."""
    samples = [sample("a", 3, 6), sample("b", 7, 7), sample("c", 2, 8)]
    path = tmp_path / "s.safetensors"
    write_shard(path, samples, dtype, {})
    tensors = load_file(path)
    assert torch.equal(tensors["input_ids"], torch.cat([s.input_ids for s in samples]))
    assert torch.equal(tensors["loss_mask"], torch.cat([s.loss_mask for s in samples]))
    assert tensors["offsets"].tolist() == [0, 3, 10, 12]
    for name in ("aux", "last"):
        rows = torch.cat([getattr(s, name) for s in samples])
        if dtype == "bf16":
            assert torch.equal(tensors[name], rows.to(torch.bfloat16)), name
        else:
            q, scale = quantize_fp8(rows)
            assert torch.equal(tensors[name].float(), q.float()) and torch.equal(tensors[f"{name}_scale"], scale), name


def test_finite_states_whose_sum_overflows_pass_the_check_and_an_inf_does_not():
    """The finite check sums first: an overflowing sum of finite states must not read as NaN/Inf."""
    big = sample("a", 4, 9)
    big.aux.fill_(3e38)  # finite, but their float32 sum is inf
    check_sample(big, big.input_ids, H)
    big.last[1, 2] = float("-inf")
    with pytest.raises(ShardError, match="NaN or Inf"):
        check_sample(big, big.input_ids, H)
