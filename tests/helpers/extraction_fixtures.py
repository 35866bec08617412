"""Test data for hidden-state extraction before sampling exists: a SampleSet written with
`sample_table.write_part`, conversations rendered with the SmolLM2 chat template, loss_mask 1 on the
assistant part; and `layer_cosines`, the agreement of two extractions of the same samples."""

from __future__ import annotations

from pathlib import Path

import torch

from eagle3_core.artifacts import HiddenStateSet, SampleSet, record_files
from eagle3_core.hidden_states.reader import HiddenStateDataset
from eagle3_core.sampling.table import sample_id, write_part

PROMPTS = [
    ("What is the capital of France?", "The capital of France is Paris."),
    ("Write a haiku about rain.", "Soft rain on the roof,\nquiet drums of grey morning,\nthe garden drinks deep."),
    ("Add 17 and 25.", "17 + 25 = 42."),
    ("Name three primary colours.", "Red, blue and yellow."),
    ("Define entropy in one sentence.", "Entropy measures how many microscopic states fit a macroscopic one."),
    ("Translate 'good morning' to Spanish.", "Buenos días."),
    ("Write a Python function that squares x.", "def square(x):\n    return x * x"),
    ("What colour is the sky on a clear day?", "It is blue, because air scatters blue light the most."),
    ("Give a synonym for 'happy'.", "Joyful."),
    ("Why do leaves fall in autumn?", "Trees shed them to save water and energy through winter."),
    ("Count from one to five.", "One, two, three, four, five."),
    ("What is 9 squared?", "81."),
]


def render(tokenizer, prompt: str, response: str) -> tuple[list[int], list[int]]:
    """Whole conversation ids and a loss mask of 1 on the assistant's tokens."""
    user = [{"role": "user", "content": prompt}]
    prompt_ids = tokenizer.apply_chat_template(user, add_generation_prompt=True, tokenize=True, return_dict=False)
    full = [*user, {"role": "assistant", "content": response}]
    ids = tokenizer.apply_chat_template(full, tokenize=True, return_dict=False)
    assert ids[: len(prompt_ids)] == prompt_ids, "chat template is not prefix-stable"
    return ids, [0] * len(prompt_ids) + [1] * (len(ids) - len(prompt_ids))


def build_sample_set(
    root: Path, tokenizer_dir: Path, num_ok: int = 8, rows_per_part: int = 4, responses: int = 1
) -> SampleSet:
    """A SampleSet of `num_ok` ok rows plus one error and one skipped row (which extraction must skip);
    `responses` consecutive ok rows answer one prompt (p0000, p0000#1, ..., p0001, ...)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    rows = []
    for i in range(num_ok):
        prompt, response = PROMPTS[i % len(PROMPTS)]
        ids, mask = render(tokenizer, prompt, response)
        rows.append(
            {
                "id": sample_id(f"p{i // responses:04d}", i % responses),
                "prompt_id": f"p{i // responses:04d}",
                "response_index": i % responses,
                "status": "ok",
                "messages": [{"role": "user", "content": prompt}],
                "response": response,
                "finish_reason": "stop",
                "prompt_tokens": mask.count(0),
                "completion_tokens": mask.count(1),
                "input_ids": ids,
                "loss_mask": mask,
            }
        )
    rows.append({"id": "p-error", "status": "error", "error": "timeout", "messages": []})
    rows.append({"id": "p-skipped", "status": "skipped", "error": "too long", "messages": []})
    root.mkdir(parents=True, exist_ok=True)
    parts = [
        write_part(rows[i : i + rows_per_part], root / f"part-{i // rows_per_part:05d}.parquet")
        for i in range(0, len(rows), rows_per_part)
    ]
    ok = [r for r in rows if r["status"] == "ok"]
    sample_set = SampleSet(
        root=str(root),
        files=record_files(root, parts),
        prompts=len(rows),
        ok=len(ok),
        error=1,
        skipped=1,
        tokens=sum(len(r["input_ids"]) for r in ok),
        loss_tokens=sum(sum(r["loss_mask"]) for r in ok),
        errors={"p-error": "timeout"},
    )
    sample_set.save()
    return sample_set


def layer_cosines(a: HiddenStateSet, b: HiddenStateSet) -> list[float]:
    """Mean cosine per stored layer (3 aux, then last) over all tokens; token ids must agree."""
    sums = torch.zeros(4, dtype=torch.float64)
    tokens = 0
    for x, y in zip(HiddenStateDataset(a, 4096), HiddenStateDataset(b, 4096), strict=True):
        assert torch.equal(x["input_ids"], y["input_ids"])
        for slot in range(3):
            sums[slot] += torch.nn.functional.cosine_similarity(x["aux"][:, slot], y["aux"][:, slot], dim=-1).sum()
        sums[3] += torch.nn.functional.cosine_similarity(x["last"], y["last"], dim=-1).sum()
        tokens += len(x["input_ids"])
    return (sums / tokens).tolist()
