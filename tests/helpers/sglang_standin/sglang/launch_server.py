"""A stand-in for `python -m sglang.launch_server` that speaks the subset of SGLang 0.5.14's HTTP API that
measurement (b) uses, with deterministic outputs, on a CPU.

It parses the real flags our lifecycle passes (names as in SGLang's `server_args.py`) and refuses any other,
as SGLang's parser does; answers `/health` and `/health_generate`; and `/generate` with `input_ids`, greedy
`sampling_params`, and optionally `return_logprob` / `top_logprobs_num` / `return_text_in_logprobs`. Token j
of a reply is a function of the prompt's `fingerprint` alone; with `--speculative-algorithm EAGLE3` each reply
carries `spec_verify_ct` and `spec_correct_drafts_histogram` (`histogram`). A child process stands in for
SGLang's scheduler. Environment: SGLANG_STANDIN_DEPART_EVERY=M (with the draft, prompts whose fingerprint is
a multiple of M take another token at DEPART_AT; the plain run's top-2 gap there is a near-tie where it is a
multiple of 2M), SGLANG_STANDIN_FAIL=1 (every `/generate` answers 500; `plain`: only a server without a draft's).
Like SGLang, it refuses to start where its gRPC port (SGLANG_GRPC_PORT, else `--port` + 10000) passes 65535.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

VOCAB = 40
DEPART_AT = 3
NEAR_TIE_GAP, CLEAR_GAP = 0.01, 5.0
REQUEST_FIELDS = {"input_ids", "sampling_params", "return_logprob", "top_logprobs_num", "return_text_in_logprobs"}


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="sglang.launch_server", allow_abbrev=False)
    parser.add_argument("--model-path", "--model", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--dtype", choices=["auto", "half", "float16", "bfloat16", "float", "float32"], default="auto")
    parser.add_argument("--tp-size", "--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--context-length", type=int)
    parser.add_argument("--mem-fraction-static", type=float)
    parser.add_argument("--disable-cuda-graph", action="store_true")
    parser.add_argument("--attention-backend")
    parser.add_argument("--sampling-backend")
    parser.add_argument("--log-level", default="info")
    parser.add_argument("--speculative-algorithm")
    parser.add_argument("--speculative-draft-model-path")
    parser.add_argument("--speculative-num-steps", type=int)
    parser.add_argument("--speculative-eagle-topk", type=int)
    parser.add_argument("--speculative-num-draft-tokens", type=int)
    return parser.parse_args(argv)


def fingerprint(input_ids: list[int]) -> int:
    return sum((i + 1) * t for i, t in enumerate(input_ids)) % 1009


def departs(seed: int, every: int) -> bool:
    return every > 0 and seed % every == 0


def near_tie(seed: int, every: int) -> bool:
    return every > 0 and seed % (2 * every) == 0


def token_ids(seed: int, n: int, with_draft: bool, every: int) -> list[int]:
    ids = [(seed * 7 + j * 13) % VOCAB for j in range(n)]
    if with_draft and departs(seed, every) and n > DEPART_AT:
        ids[DEPART_AT] = (ids[DEPART_AT] + 1) % VOCAB
    return ids


def token_text(token: int) -> str:
    return f" w{token}"


def histogram(seed: int, n: int, k: int) -> list[int]:
    """Verify steps by accepted draft tokens: step s accepts (seed + s) % (k + 1) and emits one more (the
    bonus), until the n tokens after the prefill's first are out; trimmed as SGLang keeps it."""
    counts, produced, step = [0] * (k + 1), 1, 0
    while produced < n:
        accepted = (seed + step) % (k + 1)
        counts[accepted] += 1
        produced, step = produced + accepted + 1, step + 1
    while counts and counts[-1] == 0:
        counts.pop()
    return counts


def reply(body: dict[str, Any], args: argparse.Namespace, every: int) -> dict[str, Any]:
    params = body["sampling_params"]
    if params.get("temperature") != 0.0:
        raise ValueError("the stand-in serves greedy requests only")
    ids, n = body["input_ids"], int(params["max_new_tokens"])
    seed = fingerprint(ids)
    with_draft = args.speculative_algorithm == "EAGLE3"
    out = token_ids(seed, n, with_draft, every)
    meta: dict[str, Any] = {"prompt_tokens": len(ids), "completion_tokens": n, "cached_tokens": 0,
                            "finish_reason": {"type": "length", "length": n}}  # fmt: skip
    if with_draft:
        counts = histogram(seed, n, args.speculative_num_steps)
        meta |= {"spec_verify_ct": sum(counts), "spec_correct_drafts_histogram": counts}
    if body.get("return_logprob"):
        text = body.get("return_text_in_logprobs", False)
        gaps = [NEAR_TIE_GAP if j == DEPART_AT and near_tie(seed, every) else CLEAR_GAP for j in range(n)]
        meta["output_token_logprobs"] = [[-0.1, t, token_text(t) if text else None] for t in out]
        meta["output_top_logprobs"] = [
            [[-0.1, t, token_text(t) if text else None], [-0.1 - g, (t + 1) % VOCAB, None]][: body["top_logprobs_num"]]
            for t, g in zip(out, gaps, strict=True)
        ]
    return {"text": "".join(token_text(t) for t in out), "output_ids": out, "meta_info": meta}


def handler(args: argparse.Namespace) -> type[BaseHTTPRequestHandler]:
    every = int(os.environ.get("SGLANG_STANDIN_DEPART_EVERY", "0"))
    planted = os.environ.get("SGLANG_STANDIN_FAIL")
    fail = planted == "1" or (planted == "plain" and args.speculative_algorithm is None)

    class Handler(BaseHTTPRequestHandler):
        def send(self, status: int, payload: Any) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            self.send(200 if self.path in ("/health", "/health_generate") else 404, {})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path != "/generate":
                return self.send(404, {})
            if fail:
                return self.send(500, {"error": {"message": "planted failure"}})
            if unknown := set(body) - REQUEST_FIELDS:
                return self.send(400, {"error": {"message": f"unknown fields {sorted(unknown)}"}})
            self.send(200, reply(body, args, every))

        def log_message(self, format: str, *values: Any) -> None:
            print(format % values, flush=True)

    return Handler


def check_grpc_port(args: argparse.Namespace) -> None:
    """SGLang 0.5.14's rule (`server_args.py`): its gRPC port is SGLANG_GRPC_PORT, else `--port` + 10000, and
    it refuses to start outside 1..65535."""
    grpc_port = int(os.environ.get("SGLANG_GRPC_PORT") or args.port + 10000)
    if not 1 <= grpc_port <= 65535:
        raise ValueError(f"SGLANG_GRPC_PORT ({grpc_port}) must be between 1 and 65535")


def main() -> None:
    args = parse_args(sys.argv[1:])
    check_grpc_port(args)
    scheduler = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print(f"scheduler pid {scheduler.pid}", flush=True)
    print("Load weight end. elapsed=0.25 s, type=LlamaForCausalLM, avail mem=0.00 GB", flush=True)
    server = ThreadingHTTPServer((args.host, args.port), handler(args))
    print(f"Uvicorn running on http://{args.host}:{args.port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
