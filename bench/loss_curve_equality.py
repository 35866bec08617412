"""Loss curves on real SmolLM2 data are unchanged by the training-speed work (issue 9), on the CPU.

Three steps, each run with the `eagle3_core` of the code version under test on PYTHONPATH:
  prepare  (current code) real SmolLM2-135M-Instruct hidden states of a run dir (`eagle3 extract`, hf backend)
           + its vocab map -> one file holding the packed train / validation sequences, the fresh draft's
           state (seeded `Eagle3Draft.from_target`) and the target head: every version starts identically.
  train    (any version) a fixed number of AdamW steps of that version's `run_training` from that file, fp32
           on the CPU; writes the per-step history (loss, lr, top-1 per TTT position) and validation metrics.
  compare  two or more train outputs: max relative difference of per-step loss and top-1 against the first.

  PYTHONPATH=. python bench/loss_curve_equality.py prepare --run-dir /work/main/runs/train-demo --out data.pt
  PYTHONPATH=<version root> python bench/loss_curve_equality.py train --data data.pt --out <version>.json
  PYTHONPATH=. python bench/loss_curve_equality.py compare a.json b.json ...
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

import torch


def prepare(run_dir: Path, out: Path, max_length: int, train_items: int, val_items: int, seed: int) -> None:
    from eagle3_core.artifacts import HiddenStateSet, VocabMap
    from eagle3_core.config import TargetConfig
    from eagle3_core.draft.model import DraftConfig, Eagle3Draft
    from eagle3_core.events import RunEvents
    from eagle3_core.hidden_states.reader import HiddenStateDataset
    from eagle3_core.target.prepare import prepare_target
    from eagle3_core.training.loop import split_validation
    from eagle3_core.training.loss import TargetHead
    from eagle3_core.training.phase import target_rms_eps
    from eagle3_core.vocab import load_vocab_tensors

    hidden_states = HiddenStateSet.load(run_dir / "hidden_states")
    vocab_map = VocabMap.load(run_dir / "vocab")
    target = prepare_target(TargetConfig(), RunEvents(tempfile.mkdtemp()))
    d2t, t2d = load_vocab_tensors(vocab_map, hidden_states.upstream.get("sample_set", ""))
    target_config = json.loads((target.root_path / "config.json").read_text())
    config = DraftConfig.from_target_config(target_config, vocab_map.draft_vocab_size, hidden_states.layer_ids)
    torch.manual_seed(seed)
    draft = Eagle3Draft.from_target(config, target.root_path, t2d, d2t)
    head = TargetHead.from_target(target.root_path, t2d, d2t, hidden_states.last_state_normed, target_rms_eps(target))
    everything = HiddenStateDataset(hidden_states, max_length)
    train_ids, val_ids = split_validation(everything.sample_ids, 0.15)
    train = HiddenStateDataset(hidden_states, max_length, train_ids)
    val = HiddenStateDataset(hidden_states, max_length, val_ids)
    torch.save(
        {
            "draft_config": asdict(config),
            "draft_state": draft.state_dict(),
            "head": {k: getattr(head, k) for k in ("weight", "norm_weight", "eps", "d2t", "full_weight")},
            "train": [train[i] for i in range(min(train_items, len(train)))],
            "val": [val[i] for i in range(min(val_items, len(val)))],
            "source": str(run_dir),
        },
        out,
    )
    tokens = sum(len(item["input_ids"]) for item in torch.load(out, weights_only=False)["train"])
    counts = f"{min(train_items, len(train))} train / {min(val_items, len(val))} validation sequences"
    print(f"{out}: {counts}, {tokens} train tokens")


def train(data_path: Path, out: Path, steps: int, ttt_steps: int, seed: int) -> None:
    import eagle3_core
    from eagle3_core.config import TrainingConfig
    from eagle3_core.events import RunEvents
    from eagle3_core.training.distributed import Group
    from eagle3_core.training.loop import run_training
    from eagle3_core.training.loss import TargetHead, TTTObjective

    try:
        from eagle3_core.draft.model import DraftConfig, Eagle3Draft
    except ModuleNotFoundError:  # versions before the draft/ package (eagle3_core/draft.py)
        from eagle3_core.draft import DraftConfig, Eagle3Draft

    data = torch.load(data_path, weights_only=False)
    draft = Eagle3Draft(DraftConfig(**data["draft_config"]))
    draft.load_state_dict(data["draft_state"])  # embeddings included (frozen; same values in any float dtype)
    head = TargetHead(**data["head"])
    tc = TrainingConfig(
        max_steps=steps, ttt_steps=ttt_steps, lr=3e-4, batch_size=1, checkpoint_every=10**6, seed=seed, device="cpu"
    )
    if "sharding" not in type(tc).model_fields:  # early versions read tc.sharding before the field existed
        tc = SimpleNamespace(**tc.model_dump(), sharding="ddp", keep_checkpoints=2)
    objective = TTTObjective(draft, ttt_steps, tc.step_weight, "eager")
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        group = Group(rank=0, world=1, device=torch.device("cpu"))
        done, metrics = run_training(
            objective, head, data["train"], data["val"], tc, Path(tmp) / "state", group, RunEvents(tmp)
        )
        history = torch.load(sorted((Path(tmp) / "state").glob("step-*.pt"))[-1], weights_only=False)["history"]
    report = {
        "code": str(Path(eagle3_core.__file__).parent.parent),
        "machine": f"{platform.machine()} CPU, torch {torch.__version__}",
        "steps": done,
        "ttt_steps": ttt_steps,
        "wall_s": round(time.monotonic() - start, 1),
        "history": [row for row in history if "loss" in row],
        "metrics": metrics,
    }
    out.write_text(json.dumps(report, indent=1))
    print(f"{out}: {done} steps in {report['wall_s']} s, final loss {report['history'][-1]['loss']:.5f}")


def rel_diff(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def compare(paths: list[Path], tolerance: float) -> bool:
    """Per-step loss and top-1 of each run against the first; True when all are within `tolerance`."""
    runs = [json.loads(p.read_text()) for p in paths]
    base = runs[0]
    ok = True
    keys = [k for k in base["history"][0] if k == "loss" or k.startswith("top1_")]
    val_keys = sorted(k for k in base["metrics"] if k.startswith(("val_loss", "val_top1")))
    print(f"baseline {paths[0]} ({base['code']}): {base['steps']} steps, TTT {base['ttt_steps']}, {base['machine']}")
    for path, run in zip(paths[1:], runs[1:], strict=True):
        per_key = {
            k: max(rel_diff(r[k], b[k]) for r, b in zip(run["history"], base["history"], strict=True)) for k in keys
        }
        val = max(rel_diff(run["metrics"][k], base["metrics"][k]) for k in val_keys)
        worst = max([*per_key.values(), val])
        ok &= worst < tolerance
        shown = ", ".join(f"{k} {v:.1e}" for k, v in per_key.items())
        verdict = "OK" if worst < tolerance else "DIFFERENT"
        print(f"{path} ({run['code']}): max rel diff per step: {shown}; validation {val:.1e} -> {verdict}")
    print("\nstep " + " ".join(f"{p.stem:>24}" for p in paths) + "   (loss / top1_0)")
    for i, row in enumerate(base["history"]):
        if i % 5 == 0 or i == len(base["history"]) - 1:
            cells = [f"{r['history'][i]['loss']:.6f} / {r['history'][i]['top1_0']:.4f}" for r in runs]
            print(f"{row['step']:>4} " + " ".join(f"{c:>24}" for c in cells))
    print("validation " + "; ".join(f"{k} {base['metrics'][k]:.4f}" for k in val_keys))
    return ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--run-dir", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--max-length", type=int, default=1024)
    p.add_argument("--train-items", type=int, default=16)
    p.add_argument("--val-items", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    t = sub.add_parser("train")
    t.add_argument("--data", type=Path, required=True)
    t.add_argument("--out", type=Path, required=True)
    t.add_argument("--steps", type=int, default=30)
    t.add_argument("--ttt-steps", type=int, default=3)
    t.add_argument("--seed", type=int, default=0)
    c = sub.add_parser("compare")
    c.add_argument("runs", type=Path, nargs="+")
    c.add_argument("--tolerance", type=float, default=1e-3)
    args = parser.parse_args()
    torch.set_num_threads(2)
    if args.command == "prepare":
        prepare(args.run_dir, args.out, args.max_length, args.train_items, args.val_items, args.seed)
    elif args.command == "train":
        train(args.data, args.out, args.steps, args.ttt_steps, args.seed)
    elif not compare(args.runs, args.tolerance):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
