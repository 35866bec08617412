"""EAGLE-1's input noise (`training.input_noise`): uniform noise on the target's aux states the draft reads
through fc, in training steps only, so the draft learns to cope with the error its own states carry at
decode time. EAGLE scales the amplitude by 512 over each sample's length; here a sample is a document of
the packed batch.

The noise of a step is drawn from a generator seeded by (training seed, step, rank): a resumed run draws
what the uninterrupted one drew, and ranks holding different data do not share one pattern.
"""

from __future__ import annotations

import torch

REFERENCE_LENGTH = 512  # EAGLE's: a sample of 512 tokens gets noise of amplitude exactly `training.input_noise`


def noise_seed(seed: int, step: int, rank: int) -> int:
    """The seed of step `step`'s noise on rank `rank` of a run seeded `seed` (distinct for every triple of a
    run's reach: fewer than 10**6 ranks and 10**9 steps)."""
    return (seed * 1_000_000_007 + step) * 1_000_003 + rank


def document_lengths(document_starts: torch.Tensor, tokens: int) -> torch.Tensor:
    """`flash_ttt.document_starts` [n + 1] of a batch of `tokens` (B*T) tokens -> each token's document
    length [B*T] (no host sync: the output size is given)."""
    lengths = document_starts.diff().long()  # [n]
    return torch.repeat_interleave(lengths, lengths, output_size=tokens)


def noisy_aux(batch: dict[str, torch.Tensor], amplitude: float, seed: int) -> torch.Tensor:
    """`batch["aux"]` [B, T, 3, H] plus noise U(-a/2, a/2), a = amplitude * REFERENCE_LENGTH / the token's
    document length, drawn on the batch's device from `seed`; padding (document id -1) gets none. Needs the
    loader's `document_starts` (`collate(..., ttt_steps)`)."""
    aux, document_ids = batch["aux"], batch["document_ids"]
    generator = torch.Generator(aux.device).manual_seed(seed)
    uniform = torch.rand(aux.shape, generator=generator, device=aux.device, dtype=aux.dtype) - 0.5  # [B, T, 3, H]
    lengths = document_lengths(batch["document_starts"], document_ids.numel()).view(document_ids.shape)  # [B, T]
    scale = (amplitude * REFERENCE_LENGTH / lengths) * (document_ids >= 0)  # [B, T]
    return aux + uniform * scale[:, :, None, None].to(aux.dtype)
