"""Drive a model by hand over a paged KV cache (no scheduler): fixed sequences, explicit steps.

Sequence b of n owns blocks b, b + n, b + 2n, ... (interleaved, so pages are never contiguous per
sequence), and each step goes through the engine's ModelRunner, as generation does.
"""
from types import SimpleNamespace

import torch

from tritonq.engine.runner import ModelRunner


class PagedRun:
    def __init__(self, model, num_seqs: int, max_len: int, block_size: int = 16):
        per_seq = -(-max_len // block_size)
        self.runner = ModelRunner(model, num_seqs * per_seq, block_size, num_state_slots=num_seqs)
        self.seqs = [SimpleNamespace(token_ids=[], num_computed_tokens=0,
                                     block_table=list(range(b, num_seqs * per_seq, num_seqs)))
                     for b in range(num_seqs)]

    def _step(self, new: list[list[int]], is_prefill: bool, every_row: bool) -> torch.Tensor:
        for seq, tokens in zip(self.seqs, new):
            seq.token_ids += tokens
        counts = [len(t) for t in new]
        ctx = self.runner.prepare(self.seqs, counts, is_prefill, logits_for=None if every_row else [True] * len(new))
        logits = self.runner.run(ctx)
        for seq, n in zip(self.seqs, counts):
            seq.num_computed_tokens += n
        return logits

    def prefill(self, prompts: list[list[int]], every_row: bool = True):
        """Logits of each prompt's tokens ([S_b, V] each), or [B, V] at the last tokens (every_row=False).
        Prompts may continue sequences already in the cache (a chunk)."""
        logits = self._step(prompts, True, every_row)
        return list(logits.split([len(p) for p in prompts])) if every_row else logits

    def decode(self, tokens: list[int]) -> torch.Tensor:
        """One token per sequence -> logits [B, V]."""
        return self._step([[t] for t in tokens], False, False)

    def prefill_then_decode(self, prompts: list[list[int]], steps: list[list[int]]) -> list[torch.Tensor]:
        """Prefill the prompts as one batch, then decode step i with token steps[b][i] for each sequence b: each
        sequence's logits at all its positions, [len(prompts[b]) + len(steps[b]), V]."""
        ours = [[rows] for rows in self.prefill(prompts)]
        for i in range(len(steps[0])):
            logits = self.decode([s[i] for s in steps])
            for b, rows in enumerate(ours):
                rows.append(logits[b:b + 1])
        return [torch.cat(rows) for rows in ours]
