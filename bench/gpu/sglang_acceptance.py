"""Acceptance of an exported EAGLE-3 draft inside SGLang (issue 27 item 6), on the prompts our vLLM measurement
uses (`collect_prompts` of the config: HumanEval and the run's held-out prompts), beside vLLM's numbers.

    python3 -m bench.gpu.sglang_acceptance -c configs/h200-quality.yaml --set ... --samples RUN/samples \\
        --target TARGET_DIR --draft EXPORT --site SGLANG_SITE --out sglang.json [--plain-outputs vllm_plain.json]

SGLang runs as its own server process (`python3 -m sglang.launch_server`, EAGLE3 chain: topk 1, k steps,
k + 1 draft tokens) with its own site first on its PYTHONPATH (bench/gpu/packages.py: its transformers pin
must not reach our code). Prompts go to its native `/generate` as token ids rendered by the target's chat
template (what vLLM's chat endpoint sends), greedy. Acceptance comes from SGLang's own per-request
`meta_info`: `spec_verify_ct` and the histogram of draft tokens accepted per verify step, turned into vLLM's
definitions (tau = 1 + accepted / verify steps; position i's rate = share of steps accepting more than i).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]


def sglang_command(target: Path, draft: Path | None, k: int, port: int, dtype: str, cuda_graph: bool) -> list[str]:
    """The server's command line: triton attention (the staged kernel wheel has no FlashAttention build),
    PyTorch sampling (greedy needs no flashinfer kernel), the draft as an EAGLE3 chain of `k` tokens."""
    command = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(target), "--host", "127.0.0.1"]
    command += ["--port", str(port), "--dtype", dtype, "--attention-backend", "triton", "--sampling-backend", "pytorch"]
    command += ["--mem-fraction-static", "0.4", "--max-running-requests", "32", "--log-level", "info"]
    if not cuda_graph:
        command.append("--disable-cuda-graph")
    if draft is not None:
        command += ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(draft)]
        command += ["--speculative-num-steps", str(k), "--speculative-eagle-topk", "1"]
        command += ["--speculative-num-draft-tokens", str(k + 1)]
    return command


def acceptance(metas: list[dict], k: int) -> dict:
    """tau and per-position acceptance over requests, from each `meta_info`'s histogram of accepted draft
    tokens per verify step (`spec_correct_drafts_histogram`, older name `spec_accept_histogram`)."""
    counts = [0] * (k + 1)
    for meta in metas:
        histogram = meta.get("spec_correct_drafts_histogram") or meta.get("spec_accept_histogram")
        if histogram is None:
            raise ValueError(f"no acceptance histogram in SGLang's meta_info: {sorted(meta)}")
        for accepted, steps in enumerate(histogram[: k + 1]):
            counts[accepted] += steps
    steps = sum(counts)
    per_position = [sum(counts[i + 1 :]) / max(steps, 1) for i in range(k)]
    return {
        "verify_steps": steps,
        "tau": round(1 + sum(per_position), 4),
        "per_position": [round(r, 4) for r in per_position],
    }


def chat_ids(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """The token ids vLLM's chat endpoint would prefill: the chat template with the generation prompt."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # a BatchEncoding in transformers 5


def wait_healthy(base: str, process: subprocess.Popen, log: Path, timeout_s: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if process.poll() is not None:
            tail = log.read_text(errors="replace")[-6000:]
            raise RuntimeError(f"sglang exited with {process.returncode} before it was healthy:\n{tail}")
        try:
            if httpx.get(f"{base}/health_generate", timeout=10).status_code == 200:
                return time.monotonic() - start
        except httpx.HTTPError:
            pass
        time.sleep(2)
    raise RuntimeError(f"sglang not healthy after {timeout_s} s; log {log}")


def generate(base: str, input_ids: list[int], max_new_tokens: int) -> dict:
    body = {"input_ids": input_ids, "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens}}
    response = httpx.post(f"{base}/generate", json=body, timeout=600)
    response.raise_for_status()
    return response.json()


def serve_and_measure(args, command: list[str], env: dict, prompt_ids: dict, log: Path) -> dict:
    """Start one SGLang server, send every prompt set, stop it; per set the texts and meta_infos."""
    base = f"http://127.0.0.1:{args.port}"
    with open(log, "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        healthy_s = wait_healthy(base, process, log, args.startup_timeout_s)
        sets = {}
        with ThreadPoolExecutor(args.concurrency) as pool:
            for name, ids in prompt_ids.items():
                start = time.monotonic()
                replies = list(pool.map(lambda i: generate(base, i, args.max_new_tokens), ids))
                sets[name] = {"replies": replies, "seconds": round(time.monotonic() - start, 1)}
        return {"healthy_s": round(healthy_s, 1), "sets": sets}
    finally:
        os.killpg(process.pid, 15)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, 9)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-c", "--config", type=Path, required=True)
    parser.add_argument("--set", action="append", default=[])
    parser.add_argument("--samples", type=Path, required=True, help="the SampleSet whose hold-out is measured")
    parser.add_argument("--target", type=Path, required=True, help="the converted target folder")
    parser.add_argument("--draft", type=Path, required=True, help="the exported draft")
    parser.add_argument("--site", type=Path, required=True, help="SGLang's own site (bench.gpu.device)")
    parser.add_argument("--plain-outputs", type=Path, help="vLLM's plain outputs (bench/quality.py --plain-outputs)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--startup-timeout-s", type=float, default=600)
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from eagle3_core.artifacts import SampleSet
    from eagle3_core.config import load_config
    from eagle3_core.evaluation.phase import collect_prompts

    cfg = load_config(args.config, args.set)
    args.max_new_tokens = cfg.evaluation.max_new_tokens
    k = cfg.evaluation.num_speculative_tokens
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    prompt_sets = collect_prompts(cfg, SampleSet.load(args.samples))
    prompt_ids = {
        name: [chat_ids(tokenizer, prompt.chat_messages()) for prompt in ps] for name, ps in prompt_sets.items()
    }
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(args.site), os.environ.get("PYTHONPATH", "")])}
    result: dict = {"k": k, "max_new_tokens": args.max_new_tokens, "draft": str(args.draft), "attempts": []}
    plain = json.loads(args.plain_outputs.read_text())["outputs"] if args.plain_outputs else None
    for dtype, cuda_graph in ((cfg.server.dtype, True), ("bfloat16", False)):  # the second only if the first fails
        command = sglang_command(args.target, args.draft, k, args.port, dtype, cuda_graph)
        log = args.out.with_suffix(f".{dtype}.log")
        try:
            served = serve_and_measure(args, command, env, prompt_ids, log)
        except Exception as error:  # the next attempt; the error goes into the report
            result["attempts"].append({"dtype": dtype, "cuda_graph": cuda_graph, "error": str(error)[-4000:]})
            print(f"sglang {dtype} cuda_graph={cuda_graph}: {str(error)[-2000:]}", flush=True)
            continue
        result.update({"dtype": dtype, "cuda_graph": cuda_graph, "healthy_s": served["healthy_s"], "sets": {}})
        metas_all = []
        for name, data in served["sets"].items():
            metas = [reply["meta_info"] for reply in data["replies"]]
            metas_all += metas
            row = {"prompts": len(metas), "seconds": data["seconds"], **acceptance(metas, k)}
            if plain is not None:
                texts = [reply["text"] for reply in data["replies"]]
                row["identical_to_vllm_plain"] = (
                    f"{sum(a == b for a, b in zip(texts, plain[name], strict=True))}/{len(texts)}"
                )
            result["sets"][name] = row
        result["all"] = acceptance(metas_all, k)
        break
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({key: value for key, value in result.items() if key != "attempts"}, indent=1), flush=True)


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    main()
