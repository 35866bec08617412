"""Extraction throughput on the GPU against the engine's own limit (issue 27 item 4), on a Llama-3.1-8B-shaped
target with random bf16 weights (`random_targets.py llama8b`), the same random-token samples for every run:

1. the engine's limit: a plain vLLM server (no speculative method, no connector) answering the samples'
   prefill-only requests (`max_tokens=1`), as many in flight as extraction sends;
2. the extraction server (`extract_hidden_states` method + our connector, as the pipeline starts it), one
   engine for every pass below (the connector's folder is a symlink that is re-pointed between passes):
   - `vllm_store_*`: the `vllm` backend through `extract_hidden_states` (the shard loop timed: prefill,
     connector files, read back, validation, fsync'd shard writes), with the connector's per-request files
     on the run's disk or on a tmpfs (`--shm`), at several shard sizes and requests in flight (the backend
     keeps the next shards' requests in flight while a shard is collected: `VllmBackend.extract_shards`;
     before round `stream`, a shard's requests were all answered before the next shard's were sent, so at
     most `samples_per_shard` were in flight);
   - `connector_only_*`: the same requests through `VllmBackend.extract` alone (states written by the
     connector and read back, no shard written), shard by shard or as one continuous pool;
   - `extraction_engine_no_states*`: the plain pass's requests, asking for no states (last: on vLLM 0.26
     before our connector's `request_finished` and `get_finished` fixes, this killed the engine);
3. with `--hf`, our `hf` backend on the same samples and weights (bf16, the shard loop timed), and the cosine
   per stored layer between its states and vLLM's.

Each rate is prompt tokens over the wall time of the pass; a short warm-up pass comes first on each engine.
Both engines run eager (`server.enforce_eager`): prefill batches of thousands of tokens are past every
CUDA-graph capture size, and it saves two torch.compile warm-ups of device time.

    python3 -m bench.gpu.extraction_limit --target DIR --work DIR [--samples 128 --tokens 2048] [--shm DIR] [--hf]
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
from eagle3_core.extraction.vllm_backend import VllmBackend, extraction_args
from eagle3_core.hidden_states.reader import HiddenStateDataset
from eagle3_core.progress import ProgressUpdate
from eagle3_core.sampling.table import iter_rows
from eagle3_core.serving.engine import VllmServer
from eagle3_core.target.prepare import describe_folder

CONCURRENCY = 32
COSINE_SAMPLES = 16


# (name, dtype, connector folder, samples per shard, requests in flight, shard-writer threads) of the
# full-phase passes. Round `levers`: the old run's setting first (shards of 16: at most 16 of the 32 in
# flight), then the connector's files on a tmpfs and more in flight. Round `writers`: the shard writer's
# threads (`extraction.writer_threads`), on the disk. Round `fp8`: fp8 quantised in the engine by the
# connector (half the copy, the files and the shard bytes) beside bf16 at the best setting of `writers`. Round
# `stream`: the next shards' requests in flight while a shard is collected (no barrier at a shard boundary).
# Round `steady`: the same loop on longer passes (`--samples 768`), fp8 only (bf16 would write 51 GB a pass),
# the default shard of 64 beside 16, each pass's final drain (the last shards' writes) timed apart. Round
# `steady_reversed`: shard 64 first (in `steady` it ran after 52 GB of shards), run with the plain engine measured
# in the same call (`--samples 512` leaves room for its start).
STORE_PASSES = {
    "levers": [
        ("bf16_disk_shard16_c32", "bf16", "disk", 16, 32, 2),
        ("bf16_shm_shard16_c32", "bf16", "shm", 16, 32, 2),
        ("bf16_disk_shard64_c32", "bf16", "disk", 64, 32, 2),
        ("bf16_shm_shard64_c32", "bf16", "shm", 64, 32, 2),
        ("bf16_shm_shard128_c64", "bf16", "shm", 128, 64, 2),
        ("fp8_shm_shard128_c64", "fp8", "shm", 128, 64, 2),
    ],
    "writers": [
        ("bf16_disk_shard16_c32", "bf16", "disk", 16, 32, 2),
        ("bf16_disk_shard16_c32_w4", "bf16", "disk", 16, 32, 4),
        ("bf16_disk_shard16_c32_w8", "bf16", "disk", 16, 32, 8),
        ("bf16_disk_shard32_c32_w8", "bf16", "disk", 32, 32, 8),
        ("fp8_disk_shard16_c32_w8", "fp8", "disk", 16, 32, 8),
    ],
    "fp8": [
        ("bf16_disk_shard16_c32_w4", "bf16", "disk", 16, 32, 4),
        ("fp8_disk_shard16_c32_w4", "fp8", "disk", 16, 32, 4),
        ("fp8_disk_shard32_c32_w4", "fp8", "disk", 32, 32, 4),
        ("fp8_disk_shard16_c32_w2", "fp8", "disk", 16, 32, 2),
    ],
    "stream": [
        ("fp8_disk_shard16_c32_w2", "fp8", "disk", 16, 32, 2),
        ("fp8_disk_shard16_c32_w4", "fp8", "disk", 16, 32, 4),
        ("fp8_disk_shard64_c32_w2", "fp8", "disk", 64, 32, 2),
        ("fp8_disk_shard16_c64_w2", "fp8", "disk", 16, 64, 2),
        ("bf16_disk_shard16_c32_w4", "bf16", "disk", 16, 32, 4),
    ],
    "steady": [
        ("fp8_disk_shard16_c32_w2", "fp8", "disk", 16, 32, 2),
        ("fp8_disk_shard16_c32_w4", "fp8", "disk", 16, 32, 4),
        ("fp8_disk_shard64_c32_w4", "fp8", "disk", 64, 32, 4),
    ],
    "steady_reversed": [
        ("fp8_disk_shard64_c32_w4", "fp8", "disk", 64, 32, 4),
        ("fp8_disk_shard16_c32_w2", "fp8", "disk", 16, 32, 2),
    ],
}
# (name, dtype asked of the connector, connector folder, samples per extract call, requests in flight); shard
# None: one continuous pool.
CONNECTOR_PASSES = {
    "levers": [
        ("disk_shard16_c32", "bf16", "disk", 16, 32),
        ("shm_shard16_c32", "bf16", "shm", 16, 32),
        ("disk_pool_c32", "bf16", "disk", None, 32),
        ("shm_pool_c32", "bf16", "shm", None, 32),
        ("shm_pool_c64", "bf16", "shm", None, 64),
    ],
    "writers": [("disk_pool_c32", "bf16", "disk", None, 32)],
    "fp8": [("disk_pool_c32", "bf16", "disk", None, 32), ("disk_pool_c32_fp8", "fp8", "disk", None, 32)],
    "stream": [("disk_shard16_c32_fp8", "fp8", "disk", 16, 32), ("disk_pool_c32_fp8", "fp8", "disk", None, 32)],
    "steady": [("disk_pool_c32_fp8", "fp8", "disk", None, 32)],
    "steady_reversed": [("disk_pool_c32_fp8", "fp8", "disk", None, 32)],
}
# The two sets compared state by state, per layer: the tmpfs must not change a state; fp8 from the engine
# must be the bf16 state within e4m3's rounding.
COMPARED = {
    "levers": ("bf16_disk_shard16_c32", "bf16_shm_shard128_c64"),
    "writers": (),
    "fp8": ("bf16_disk_shard16_c32_w4", "fp8_disk_shard16_c32_w4"),
    "stream": (),
    "steady": (),
    "steady_reversed": (),
}


def pipeline_config(
    run_dir: Path,
    tokens: int,
    backend: str = "vllm",
    dtype: str = "bf16",
    shard: int = 16,
    in_flight: int = 32,
    writers: int = 2,
) -> PipelineConfig:
    return PipelineConfig.model_validate({
        "run_dir": str(run_dir),
        "server": {"dtype": "bfloat16", "max_model_len": tokens + 16, "gpu_memory_utilization": 0.85,
                   "enforce_eager": True, "env": {"VLLM_USE_FLASHINFER_SAMPLER": "0"}, "startup_timeout_s": 900},
        "sampling": {"holdout_fraction": 0.0},
        "extraction": {"backend": backend, "dtype": dtype, "concurrency": in_flight, "samples_per_shard": shard,
                       "batch_size": 4, "compute_dtype": "bfloat16", "layer_ids": [2, 16, 29],
                       "writer_threads": writers},
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
) -> tuple[HiddenStateSet, float, float]:
    """The extraction phase on `server` (None: the hf backend loads the target): the shard loop's seconds and
    its drain, the seconds from the last shard handed to the writer to the loop's end (its last writes, which
    a run pays once whatever its length)."""
    spent: list[float] = []
    handed: list[float] = []
    run_shards = phase.run_shards

    def timed(*args: Any, **kwargs: Any) -> None:
        start = time.perf_counter()
        run_shards(*args, **kwargs)
        spent.extend((time.perf_counter() - start, time.perf_counter()))

    def progress(update: ProgressUpdate) -> None:
        if update.stage == "samples":
            handed.append(time.perf_counter())

    phase.run_shards = timed
    try:
        states = phase.extract_hidden_states(config, samples, target, RunEvents(config.run_dir), progress, server)
    finally:
        phase.run_shards = run_shards
    seconds, ended = spent
    return states, seconds, ended - handed[-1]


def connector_pass(
    base_url: str, rows: list[dict[str, Any]], shard: int | None, in_flight: int, dtype: str = "bf16"
) -> float:
    """Prompt tokens/s of `VllmBackend.extract` alone: states written by the connector as `dtype` and read back
    (lock, load, delete), checked against the prompt ids, no shard written; `shard` rows at a time (None: all)."""
    backend = VllmBackend(base_url, None, in_flight, 600, lambda wait_s: None, dtype)
    chunks = [rows] if shard is None else [rows[i : i + shard] for i in range(0, len(rows), shard)]
    try:
        start = time.perf_counter()
        for chunk in chunks:
            backend.extract(chunk)
        seconds = time.perf_counter() - start
    finally:
        backend.close()
    return sum(len(row["input_ids"]) for row in rows) / seconds


def point(link: Path, folder: Path) -> None:
    """Re-point the connector's folder (a symlink; the engine joins it with each request's file name)."""
    folder.mkdir(parents=True, exist_ok=True)
    fresh = link.with_name(link.name + ".new")
    fresh.unlink(missing_ok=True)
    fresh.symlink_to(folder, target_is_directory=True)
    fresh.replace(link)


def rate_of(tokens_per_s: float, plain_rate: float) -> dict[str, float]:
    return {"tokens_per_s": round(tokens_per_s), "vs_plain_engine": round(tokens_per_s / plain_rate, 3)}


def stored(states: HiddenStateSet, seconds: float, plain_rate: float, drain_s: float) -> dict[str, float]:
    """The pass's rate, and without its drain: the rate of a run long enough that its last writes do not count."""
    written = states.bytes_per_token * states.tokens
    return rate_of(states.tokens / seconds, plain_rate) | {
        "bytes_per_token": round(states.bytes_per_token, 1),
        "gb_written": round(written / 1e9, 2),
        "drain_s": round(drain_s, 2),
        "vs_plain_engine_without_drain": round(states.tokens / (seconds - drain_s) / plain_rate, 3),
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


class Results(dict):
    """The results so far, re-written to `out` after every pass (a call cut mid-run keeps what it measured)."""

    def __init__(self, out: Path | None, **first: Any):
        super().__init__(first)
        self.out = out

    def save(self) -> None:
        if self.out:
            self.out.write_text(json.dumps(self, indent=2))

    def measure(self, name: str, measure: Any) -> Any:
        """`measure()`'s row under `name`; a failing pass is recorded as its error and the next one runs."""
        try:
            self[name] = measure()
        except Exception as exc:  # a benchmark row: reported, and the next pass runs
            self[name] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:500]}
        print(name, json.dumps(self[name]), flush=True)
        self.save()
        return self[name]


def run(
    target_dir: Path,
    work: Path,
    samples: int,
    tokens: int,
    shm: Path,
    with_hf: bool,
    out: Path | None = None,
    round_: str = "levers",
    plain_rate: float | None = None,
) -> dict[str, Any]:
    target = describe_folder(target_dir, target_dir.name, "local")
    sample_set = cpu_sample_set(work / "samples", 49152, samples, tokens)
    warm = cpu_sample_set(work / "warm-samples", 49152, 8, tokens)
    rows, warm_rows = list(iter_rows(sample_set)), list(iter_rows(warm))
    results = Results(out, device=torch.cuda.get_device_name(), samples=samples, tokens=samples * tokens)
    results["disk_write_gb_per_s"] = round(disk_write_gb_per_s(work / "probe"), 2)
    results["shm"] = {"path": str(shm), "free_gb": round(shutil.disk_usage(shm).free / 1e9, 1)}
    results["round"] = round_
    config = pipeline_config(work / "vllm-bf16", tokens)
    if plain_rate is not None:  # measured before (a plain engine start saved)
        results["plain_engine"] = {"tokens_per_s": round(plain_rate), "in_flight": CONCURRENCY, "given": True}
    else:
        begun = time.monotonic()
        with VllmServer(config.server, target.root_path, work / "plain", RunEvents(work / "plain"),
                        phase="sampling") as plain:  # fmt: skip
            results["plain_engine_healthy_s"] = round(time.monotonic() - begun, 1)
            prefill_pass(plain.base_url, warm_rows, CONCURRENCY)
            plain_rate = prefill_pass(plain.base_url, rows, CONCURRENCY)
            results["plain_engine"] = {"tokens_per_s": round(plain_rate), "in_flight": CONCURRENCY}
            # (a second pass of the same rows would be answered from the prefix cache: not measured)
    results.save()
    folders = {"disk": work.resolve() / "incoming-disk", "shm": shm.resolve() / "eagle3-limit-incoming"}
    link = work.resolve() / "incoming"
    point(link, folders["disk"])
    args = extraction_args(config.extraction.layer_ids, target.num_layers, link)
    begun = time.monotonic()
    sets: dict[str, HiddenStateSet] = {}
    with VllmServer(config.server, target.root_path, work / "extract", RunEvents(work / "extract"),
                    extra_args=args, phase="extraction") as server:  # fmt: skip
        results["extraction_engine_healthy_s"] = round(time.monotonic() - begun, 1)
        timed_phase(pipeline_config(work / "warm-vllm", tokens), warm, target, server)
        for name, dtype, where, shard, in_flight, writers in STORE_PASSES[round_]:

            def store_pass(name: str = name, dtype: str = dtype, shard: int = shard, in_flight: int = in_flight,
                           where: str = where, writers: int = writers) -> dict[str, Any]:  # fmt: skip
                point(link, folders[where])
                store = pipeline_config(work / f"vllm-{name}", tokens, dtype=dtype, shard=shard, in_flight=in_flight,
                                        writers=writers)  # fmt: skip
                states, seconds, drain_s = timed_phase(store, sample_set, target, server)
                if name in COMPARED[round_]:
                    sets[name] = states  # compared below: the tmpfs must not change a state
                else:
                    shutil.rmtree(work / f"vllm-{name}", ignore_errors=True)
                where_and_how = {
                    "connector_files": where,
                    "samples_per_shard": shard,
                    "in_flight": in_flight,
                    "writer_threads": writers,
                }
                return stored(states, seconds, plain_rate, drain_s) | where_and_how

            results.measure(f"vllm_store_{name}", store_pass)
        for name, dtype, where, shard, in_flight in CONNECTOR_PASSES[round_]:

            def connector_only(dtype: str = dtype, where: str = where, shard: int | None = shard,
                               in_flight: int = in_flight) -> Any:  # fmt: skip
                point(link, folders[where])
                rate = connector_pass(server.base_url, rows, shard, in_flight, dtype)
                how = {"dtype": dtype, "connector_files": where, "in_flight": min(shard or in_flight, in_flight)}
                return rate_of(rate, plain_rate) | how

            results.measure(f"connector_only_{name}", connector_only)
        point(link, folders["disk"])
        for name, in_flight in (("", CONCURRENCY), ("_c64", 2 * CONCURRENCY)):
            # last: where the connector cannot take a request that asks for no states, the engine dies
            row = results.measure(f"extraction_engine_no_states{name}", lambda n=in_flight: rate_of(
                prefill_pass(server.base_url, rows, n), plain_rate) | {"in_flight": n})  # fmt: skip
            if "error" in row:
                break
    if COMPARED[round_] and len(sets) == 2:
        a, b = (sets[name] for name in COMPARED[round_])
        compared = "_vs_".join(COMPARED[round_])
        results.measure(f"cosine_{compared}_per_layer", lambda: layer_cosines(a, b, COSINE_SAMPLES))
    shutil.rmtree(folders["shm"], ignore_errors=True)
    for name in COMPARED[round_][1:]:
        shutil.rmtree(work / f"vllm-{name}", ignore_errors=True)
    if with_hf and "bf16_disk_shard16_c32" in sets:

        def hf_pass() -> dict[str, Any]:
            hf_config = pipeline_config(work / "hf-bf16", tokens, backend="hf")
            hf_states, seconds, drain_s = timed_phase(hf_config, sample_set, target, None)
            vllm_states = sets["bf16_disk_shard16_c32"]
            results["cosine_vllm_vs_hf_per_layer"] = layer_cosines(vllm_states, hf_states, COSINE_SAMPLES)
            return stored(hf_states, seconds, plain_rate, drain_s)

        results.measure("hf_store_bf16", hf_pass)
    results.save()
    return dict(results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", type=Path, required=True)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--shm", type=Path, default=Path("/dev/shm"), help="a tmpfs for the connector's files")
    parser.add_argument("--hf", action="store_true", help="also the hf backend and its cosines against vLLM's")
    parser.add_argument("--round", choices=sorted(STORE_PASSES), default="levers", help="which passes")
    parser.add_argument("--plain-rate", type=float, help="the plain engine's tokens/s measured before: no plain start")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    results = run(args.target, args.work, args.samples, args.tokens, args.shm, args.hf, args.out, args.round,
                  args.plain_rate)  # fmt: skip
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
