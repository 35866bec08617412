"""Greedy responses for the quality protocol, generated with transformers where vLLM is not installed (the
lent H200), then imported here as the flow's own SampleSet.

    python bench/quality_responses.py generate --model DIR --out responses.jsonl       # on the GPU
    python bench/quality_responses.py import responses.jsonl -c configs/quality.yaml   # here

`generate` decodes greedily in float32 (TF32 off), the prompt rendered by the same chat template vLLM
applies, at most `sampling.max_tokens` (384) new tokens and never past `server.max_model_len`, stopping at
the target's end-of-sequence ids: the completions plain greedy vLLM gives in float32 up to rounding.
`import` turns each completion into a row exactly as the sampler does (`ChatTokenizer.token_view`) and
writes the SampleSet under the run key of the config, with one `decision` line in events.jsonl saying
where the responses came from, so `eagle3 sample -c configs/quality.yaml` afterwards returns it Cached.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

PROMPTS = Path(__file__).parent / "data" / "quality_prompts_600.jsonl"


def generate(model_dir: Path, out: Path, max_tokens: int, max_model_len: int, batch_size: int) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from eagle3_core.sampling.chat_tokens import ChatTokenizer

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    tokens = ChatTokenizer(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()
    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos])
    pad = tokens.tokenizer.pad_token_id if tokens.tokenizer.pad_token_id is not None else next(iter(eos_ids))
    prompts = [json.loads(line) for line in PROMPTS.read_text().splitlines() if line.strip()]
    rendered = [(p, tokens.prompt_ids(p["messages"])) for p in prompts]
    rendered.sort(key=lambda item: len(item[1]))
    start = time.time()
    with out.open("w") as sink:
        for first in range(0, len(rendered), batch_size):
            batch = rendered[first : first + batch_size]
            width = max(len(ids) for _, ids in batch)
            budget = min(max_tokens, max_model_len - width)
            input_ids = torch.full((len(batch), width), pad, dtype=torch.long)
            attention = torch.zeros((len(batch), width), dtype=torch.long)
            for row, (_, ids) in enumerate(batch):  # left padding
                input_ids[row, width - len(ids) :] = torch.tensor(ids)
                attention[row, width - len(ids) :] = 1
            with torch.no_grad():
                generated = model.generate(
                    input_ids=input_ids.cuda(),
                    attention_mask=attention.cuda(),
                    max_new_tokens=budget,
                    do_sample=False,
                    pad_token_id=pad,
                )[:, width:].tolist()
            for (prompt, ids), completion in zip(batch, generated, strict=True):
                ended = next((i for i, t in enumerate(completion) if t in eos_ids), None)
                kept = completion if ended is None else completion[:ended]
                sink.write(
                    json.dumps(
                        {
                            "id": prompt["id"],
                            "response": tokens.tokenizer.decode(kept, skip_special_tokens=True),
                            "finish_reason": "length" if ended is None else "stop",
                            "prompt_tokens": len(ids),
                            "completion_tokens": len(kept) + (ended is not None),
                        }
                    )
                    + "\n"
                )
            print(f"{first + len(batch)}/{len(rendered)} prompts, {time.time() - start:.0f} s", flush=True)


def import_responses(responses: Path, config_file: Path) -> None:
    from eagle3_core.config import load_config
    from eagle3_core.events import DECISION, RunEvents
    from eagle3_core.sampling.chat_tokens import ChatTokenizer, split_reasoning
    from eagle3_core.sampling.prompts import load_prompts
    from eagle3_core.sampling.store import SampleStore
    from eagle3_core.target.prepare import prepare_target

    config = load_config(config_file)
    events = RunEvents(config.run_dir)
    target = prepare_target(config.target, events)
    prompts = load_prompts(config.sampling.prompt_files, config.sampling.max_prompts)
    answers = {a["id"]: a for a in map(json.loads, responses.read_text().splitlines())}
    missing = [p.id for p in prompts if p.id not in answers]
    if missing:
        raise SystemExit(f"{responses}: no response for {len(missing)} prompts, e.g. {missing[:3]}")
    store = SampleStore.of_run(config, target, prompts, events)
    store.resume({p.id for p in prompts})
    tokens = ChatTokenizer(target.root)
    writer = store.writer(config.sampling.rows_per_part)
    for prompt in prompts:
        answer = answers[prompt.id]
        reasoning, response = split_reasoning(answer["response"])
        view = tokens.token_view(prompt.messages, reasoning, response)
        writer.add(
            {
                "id": prompt.id,
                "messages": prompt.messages,
                "status": "ok",
                "reasoning": reasoning,
                "response": response,
                "finish_reason": answer["finish_reason"],
                "prompt_tokens": answer["prompt_tokens"],
                "completion_tokens": answer["completion_tokens"],
                "input_ids": view.input_ids,
                "loss_mask": view.loss_mask,
            }
        )
    writer.flush()
    sample_set = store.finish(target, prompts)
    events.record(
        "sampling",
        DECISION,
        f"imported {len(prompts)} greedy responses generated by transformers in float32 from {responses} "
        "(bench/quality_responses.py), not by a vLLM server",
        source=str(responses),
    )
    print(f"wrote {sample_set.ok} rows to {store.out_dir}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    verbs = parser.add_subparsers(dest="verb", required=True)
    gen = verbs.add_parser("generate")
    gen.add_argument("--model", type=Path, required=True)
    gen.add_argument("--out", type=Path, required=True)
    gen.add_argument("--max-tokens", type=int, default=384)
    gen.add_argument("--max-model-len", type=int, default=2048)
    gen.add_argument("--batch-size", type=int, default=100)
    imp = verbs.add_parser("import")
    imp.add_argument("responses", type=Path)
    imp.add_argument("-c", "--config", type=Path, default=Path("configs/quality.yaml"))
    args = parser.parse_args()
    if args.verb == "generate":
        generate(args.model, args.out, args.max_tokens, args.max_model_len, args.batch_size)
    else:
        import_responses(args.responses, args.config)


if __name__ == "__main__":
    main()
