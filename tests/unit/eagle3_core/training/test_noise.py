"""EAGLE-1's input noise (`training.input_noise`): uniform, of amplitude a * 512 / the document's length on
every real token's aux states, none on padding, the same for the same (seed, step, rank)."""

from __future__ import annotations

import torch

from eagle3_core.training.batches import collate
from eagle3_core.training.noise import REFERENCE_LENGTH, noise_seed, noisy_aux
from tests.helpers.training_data import CPU, synthetic_data


def test_noise_has_eagle_amplitude_per_document_and_spares_padding() -> None:
    items = synthetic_data(2, seed=3)
    batch = collate(items, CPU.device, 8, ttt_steps=2)  # padded to a multiple of 8: padding in both rows
    noise = noisy_aux(batch, 0.2, noise_seed(0, 0, 0)) - batch["aux"]  # [B, T, 3, H]
    document_ids = batch["document_ids"]
    assert bool((document_ids < 0).any()) and bool((noise[document_ids < 0] == 0).all())
    for row, ids in enumerate(document_ids):
        for document in ids[ids >= 0].unique():
            tokens = ids == document
            half_width = 0.2 * REFERENCE_LENGTH / int(tokens.sum()) / 2  # U(-a/2, a/2)
            drawn = noise[row, tokens].abs()
            assert float(drawn.max()) <= half_width and float(drawn.max()) > 0.95 * half_width
            assert abs(float(noise[row, tokens].mean())) < 0.05 * half_width  # centred


def test_noise_is_drawn_from_seed_step_and_rank() -> None:
    batch = collate(synthetic_data(2), CPU.device, 1, ttt_steps=2)
    seeds = [noise_seed(0, 4, 0), noise_seed(0, 4, 1), noise_seed(0, 5, 0), noise_seed(1, 4, 0)]
    assert len(set(seeds)) == len(seeds)
    first = noisy_aux(batch, 0.2, seeds[0])
    assert torch.equal(first, noisy_aux(batch, 0.2, seeds[0]))
    assert not any(torch.equal(first, noisy_aux(batch, 0.2, seed)) for seed in seeds[1:])
