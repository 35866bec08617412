"""Extraction throughput on the GPU against the engine's own limit (issue 27 item 4), on a Llama-3.1-8B-shaped
target with random bf16 weights (`random_targets.py llama8b`), the same random-token samples for every run:

1. the engine's limit: a plain vLLM server (no speculative method, no connector) answering the samples'
   prefill-only requests (`max_tokens=1`), as many in flight as extraction sends;
2. the extraction server (`extract_hidden_states` method + our connector, as the pipeline starts it): the same
   requests asking for no states, then the `vllm` backend through `extract_hidden_states` storing bf16 and
   fp8 shards (the shard loop timed: prefill, connector files, validation, fsync'd writes);
3. our `hf` backend on the same samples and weights (bf16, the shard loop timed), and the cosine per stored
   layer between its states and vLLM's.

Each rate is prompt tokens over the wall time of the pass; a short warm-up pass comes first each time. Both
engines run eager (`server.enforce_eager`): prefill batches of thousands of tokens are past every CUDA-graph
capture size, and it saves two torch.compile warm-ups of device time.

    python3 -m bench.gpu.extraction_limit --target DIR --work DIR [--samples 128 --tokens 2048]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import torch

from bench.extraction_speed import cpu_sample_set
from eagle3_core.artifacts import HiddenStateSet, SampleSet, TargetModel
from eagle3_core.config import PipelineConfig
from eagle3_core.events import RunEvents
from eagle3_core.extraction import phase
from eagle3_core.extraction.reader import HiddenStateDataset
from eagle3_core.extraction.vllm_backend import extraction_args
from eagle3_core.sampling.table import iter_rows
from eagle3_core.serving.engine import VllmServer, requests_in_flight
from eagle3_core.target.prepare import describe_folder

CONCURRENCY = 32
COSINE_SAMPLES = 16


def pipeline_config(run_dir: Path, tokens: int, backend: str = "vllm", dtype: str = "bf16") -> PipelineConfig:
    return PipelineConfig.model_validate({
        "run_dir": str(run_dir),
        "server": {"dtype": "bfloat16", "max_model_len": tokens + 16, "gpu_memory_utilization": 0.85,
                   "enforce_eager": True, "env": {"VLLM_USE_FLASHINFER_SAMPLER": "0"}, "startup_timeout_s": 900},
        "sampling": {"holdout_fraction": 0.0},
        "extraction": {"backend": backend, "dtype": dtype, "concurrency": CONCURRENCY, "samples_per_shard": 16,
                       "batch_size": 4, "compute_dtype": "bfloat16", "layer_ids": [2, 16, 29]},
    })  # fmt: skip


def prefill_pass(base_url: str, rows: list[dict[str, Any]], in_flight: int) -> float:
    """Prompt tokens/s of prefill-only requests that ask for no states."""
    with httpx.Client(base_url=base_url, timeout=600) as client:
        model = client.get("/v1/models").json()["data"][0]["id"]

        def one(row: dict[str, Any]) -> None:
            body = {"model": model, "prompt": list(row["input_ids"]), "max_tokens": 1, "temperature": 0.0}
            client.post("/v1/completions", json=body).raise_for_status()

        start = time.perf_counter()
        with ThreadPoolExecutor(in_flight) as pool:
            list(pool.map(one, rows))
        seconds = time.perf_counter() - start
    return sum(len(row["input_ids"]) for row in rows) / seconds


def timed_phase(
    config: PipelineConfig, samples: SampleSet, target: TargetModel, server: Any
) -> tuple[HiddenStateSet, float]:
    """The extraction phase on `server` (None: the hf backend loads the target); the shard loop's seconds."""
    spent: list[float] = []
    run_shards = phase.run_shards

    def timed(*args: Any, **kwargs: Any) -> None:
        start = time.perf_counter()
        run_shards(*args, **kwargs)
        spent.append(time.perf_counter() - start)

    phase.run_shards = timed
    try:
        states = phase.extract_hidden_states(config, samples, target, RunEvents(config.run_dir), server=server)
    finally:
        phase.run_shards = run_shards
    return states, spent[0]


def rate_of(tokens_per_s: float, plain_rate: float) -> dict[str, float]:
    return {"tokens_per_s": round(tokens_per_s), "vs_plain_engine": round(tokens_per_s / plain_rate, 3)}


def stored(states: HiddenStateSet, seconds: float, plain_rate: float) -> dict[str, float]:
    written = states.bytes_per_token * states.tokens
    return rate_of(states.tokens / seconds, plain_rate) | {
        "bytes_per_token": round(states.bytes_per_token, 1),
        "gb_written": round(written / 1e9, 2),
    }


def layer_cosines(a: HiddenStateSet, b: HiddenStateSet, samples: int) -> list[float]:
    """Mean cosine per stored layer (3 aux, last) over the first `samples` samples."""
    sums, count = torch.zeros(4, dtype=torch.float64), 0
    pairs = zip(HiddenStateDataset(a, 1 << 16), HiddenStateDataset(b, 1 << 16), strict=True)
    for x, y in itertools.islice(pairs, samples):
        stacked_x = torch.cat([x["aux"], x["last"][:, None]], dim=1).float()  # [T, 4, H]
        stacked_y = torch.cat([y["aux"], y["last"][:, None]], dim=1).float()
        sums += torch.nn.functional.cosine_similarity(stacked_x, stacked_y, dim=-1).sum(0).double()
        count += len(x["input_ids"])
    return [round(float(c), 6) for c in sums / count]


def disk_write_gb_per_s(folder: Path, gib: int = 4) -> float:
    """Sequential fsync'd write rate of the scratch disk, for the seeds' disk-bound comparison."""
    folder.mkdir(parents=True, exist_ok=True)
    block = torch.randint(0, 255, (2**26,), dtype=torch.uint8).numpy().tobytes()  # 64 MiB
    start = time.perf_counter()
    with open(folder / "disk-probe", "wb") as out:
        for _ in range(gib * 16):
            out.write(block)
        out.flush()
        os.fsync(out.fileno())
    seconds = time.perf_counter() - start
    (folder / "disk-probe").unlink()
    return gib * 2**30 / seconds / 1e9


def run(target_dir: Path, work: Path, samples: int, tokens: int) -> dict[str, Any]:
    target = describe_folder(target_dir, target_dir.name, "local")
    sample_set = cpu_sample_set(work / "samples", 49152, samples, tokens)
    warm = cpu_sample_set(work / "warm-samples", 49152, 8, tokens)
    rows, warm_rows = list(iter_rows(sample_set)), list(iter_rows(warm))
    results: dict[str, Any] = {"device": torch.cuda.get_device_name(), "samples": samples, "tokens": samples * tokens}
    results["disk_write_gb_per_s"] = round(disk_write_gb_per_s(work / "probe"), 2)
    config = pipeline_config(work / "vllm-bf16", tokens)
    in_flight = requests_in_flight(config.server, CONCURRENCY)
    events = RunEvents(work / "plain")
    begun = time.monotonic()
    with VllmServer(config.server, target.root_path, work / "plain", events, phase="sampling") as plain:
        results["plain_engine_healthy_s"] = round(time.monotonic() - begun, 1)
        prefill_pass(plain.base_url, warm_rows, in_flight)
        plain_rate = prefill_pass(plain.base_url, rows, in_flight)
    results["plain_engine"] = {"tokens_per_s": round(plain_rate)}
    incoming = (work / "incoming").resolve()
    incoming.mkdir(parents=True, exist_ok=True)
    args = extraction_args(config.extraction.layer_ids, target.num_layers, incoming)
    begun = time.monotonic()
    sets: dict[str, HiddenStateSet] = {}
    with VllmServer(config.server, target.root_path, work / "extract", RunEvents(work / "extract"),
                    extra_args=args, phase="extraction") as server:  # fmt: skip
        results["extraction_engine_healthy_s"] = round(time.monotonic() - begun, 1)
        timed_phase(pipeline_config(work / "warm-vllm", tokens), warm, target, server)
        for dtype in ("fp8", "bf16"):
            store = pipeline_config(work / f"vllm-{dtype}", tokens, dtype=dtype)
            states, seconds = timed_phase(store, sample_set, target, server)
            results[f"vllm_store_{dtype}"] = stored(states, seconds, plain_rate)
            sets[dtype] = states
        try:  # last: where the connector cannot take a request that asks for no states, the engine dies
            results["extraction_engine_no_states"] = rate_of(prefill_pass(server.base_url, rows, in_flight), plain_rate)
        except httpx.HTTPStatusError as exc:
            results["extraction_engine_no_states"] = {"error": str(exc).splitlines()[0], "answer": exc.response.text}
    shutil.rmtree(work / "vllm-fp8", ignore_errors=True)
    hf_states, seconds = timed_phase(pipeline_config(work / "hf-bf16", tokens, backend="hf"), sample_set, target, None)
    results["hf_store_bf16"] = stored(hf_states, seconds, plain_rate)
    results["cosine_vllm_vs_hf_per_layer"] = layer_cosines(sets["bf16"], hf_states, COSINE_SAMPLES)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", type=Path, required=True)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    results = run(args.target, args.work, args.samples, args.tokens)
    text = json.dumps(results, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
