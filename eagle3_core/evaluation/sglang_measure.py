"""Measurement (b) in SGLang (`served.measure_served` runs it), for a user who wants the other engine's word
on the draft: `evaluation.engine: sglang`.

The target is served by `python -m sglang.launch_server` (`serving.sglang`), with the exported draft as an
EAGLE3 chain (top-k 1, k steps, k + 1 draft tokens) and without. Prompts go to SGLang's native `/generate`
as the token ids vLLM's chat endpoint would prefill (`sampling.chat_tokens`), greedy. Acceptance is
SGLang's own: each reply's `meta_info` histogram of draft tokens accepted per verify step
(`spec_correct_drafts_histogram`, older `spec_accept_histogram`), summed as `AcceptanceStats`. A departure
from plain greedy is judged with the plain server's `output_top_logprobs` (top 2) as for vLLM.
"""

from __future__ import annotations

import subprocess
from typing import Any

import httpx

from eagle3_core.evaluation.departures import TokenGap, top2_gap
from eagle3_core.evaluation.prompts import EvalPrompt
from eagle3_core.evaluation.served import PHASE, Measurement, measure_served
from eagle3_core.evaluation.stats import AcceptanceStats
from eagle3_core.serving.lifecycle import EngineServer
from eagle3_core.serving.sglang import SglangLaunch, SglangServer, sglang_env, sglang_launch, speculative_flags

HISTOGRAMS = ("spec_correct_drafts_histogram", "spec_accept_histogram")  # SGLang 0.5.14's name, then the older
TOP2 = {"return_logprob": True, "top_logprobs_num": 2, "return_text_in_logprobs": True}
PromptIds = dict[tuple[str, str], list[int]]  # (prompt set, prompt id) -> the rendered prompt's token ids


def sglang_unavailable(launch: SglangLaunch) -> str | None:
    """Why SGLang cannot be started here (its interpreter missing or unable to find the sglang package in its
    environment), or None."""
    check = "import importlib.util, sys; sys.exit(importlib.util.find_spec('sglang') is None)"
    try:
        done = subprocess.run([launch.python, "-c", check], env=sglang_env(launch), capture_output=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"evaluation.sglang_python {launch.python} cannot run ({exc})"
    if done.returncode != 0:
        return f"sglang is not importable by {launch.python} (evaluation.sglang_python, evaluation.sglang_env)"
    return None


def histogram_stats(metas: list[dict[str, Any]], k: int) -> AcceptanceStats:
    """Acceptance over replies from their `meta_info` histograms; each must agree with its `spec_verify_ct`.
    Replies without a histogram verified nothing; when none has one, no draft ran, which is an error (a
    server started without its draft otherwise reads as zero acceptance)."""
    total, counted = AcceptanceStats(k), 0
    for meta in metas:
        histogram = next((meta[name] for name in HISTOGRAMS if meta.get(name)), None)
        if histogram is None:
            continue
        stats = AcceptanceStats.from_histogram(k, histogram)
        if meta.get("spec_verify_ct", stats.drafts) != stats.drafts:
            raise ValueError(
                f"SGLang's histogram {histogram} does not add up to spec_verify_ct {meta['spec_verify_ct']}"
            )
        total, counted = total.merge(stats), counted + 1
    if metas and not counted:
        raise ValueError(f"no acceptance histogram in SGLang's meta_info (keys {sorted(metas[0])}): no draft ran")
    return total


def top_gaps(meta: dict[str, Any]) -> list[TokenGap]:
    """Each generated token's text (as bytes) and top-2 gap, from `output_token_logprobs` and
    `output_top_logprobs` ([logprob, token id, text] entries)."""
    tokens, tops = meta["output_token_logprobs"], meta["output_top_logprobs"]
    return [
        TokenGap((token[2] or "").encode(), top2_gap([entry[0] for entry in top or []]))
        for token, top in zip(tokens, tops, strict=True)
    ]


class SglangClient:
    """The calls measurement (b) makes to SGLang's native API (`served.ServedClient`). Every reply's
    `meta_info` is kept, so acceptance over a pass is what its replies' histograms say."""

    def __init__(self, base_url: str, prompt_ids: PromptIds, k: int, timeout_s: float):
        self.http = httpx.Client(base_url=base_url, timeout=timeout_s)
        self.prompt_ids, self.k = prompt_ids, k
        self.metas: list[dict[str, Any]] = []

    def close(self) -> None:
        self.http.close()

    def model_id(self) -> str:
        return ""  # the native API serves its one model

    def generate(self, prompt: EvalPrompt, max_tokens: int, extra: dict[str, Any]) -> dict[str, Any]:
        body = {
            "input_ids": self.prompt_ids[(prompt.prompt_set, prompt.id)],
            "sampling_params": {"temperature": 0.0, "max_new_tokens": max_tokens},
            **extra,
        }
        response = self.http.post("/generate", json=body)
        if response.status_code != 200:
            raise RuntimeError(f"prompt {prompt.id}: HTTP {response.status_code}: {response.text[:500]}")
        return response.json()

    def chat(self, model: str, prompt: EvalPrompt, max_tokens: int) -> tuple[str, int]:
        reply = self.generate(prompt, max_tokens, {})
        self.metas.append(reply["meta_info"])
        return reply["text"], int(reply["meta_info"]["completion_tokens"])

    def chat_top2(self, model: str, prompt: EvalPrompt, max_tokens: int) -> tuple[str, list[TokenGap]]:
        reply = self.generate(prompt, max_tokens, TOP2)
        return reply["text"], top_gaps(reply["meta_info"])

    def acceptance_mark(self) -> int:
        return len(self.metas)

    def acceptance_since(self, mark: int) -> AcceptanceStats:
        return histogram_stats(self.metas[mark:], self.k)


def measure_sglang(measurement: Measurement) -> dict[str, Any]:
    """Measurement (b) in SGLang, with the result schema of `measure_vllm` (`engine` "sglang")."""
    from eagle3_core.sampling.chat_tokens import ChatTokenizer

    m, config = measurement, measurement.config
    evaluation, k = config.evaluation, config.evaluation.num_speculative_tokens
    tokenizer = ChatTokenizer(m.target_dir)
    ids = {
        (p.prompt_set, p.id): tokenizer.prompt_ids(p.chat_messages(), p.tools())
        for ps in m.prompt_sets.values()
        for p in ps
    }
    launch = sglang_launch(evaluation)

    def serve(with_draft: bool) -> SglangServer:
        extra = evaluation.sglang_args + (speculative_flags(m.draft_dir, k) if with_draft else [])
        server_args = (config.server, m.target_dir, config.run_dir, m.events, m.progress, extra)
        return SglangServer(launch, *server_args, phase=PHASE)

    def connect(server: EngineServer) -> SglangClient:
        return SglangClient(server.base_url, ids, k, config.sampling.request_timeout_s)

    return measure_served(measurement, "sglang", serve, connect)
