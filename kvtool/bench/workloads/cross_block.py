"""Prompts of k full blocks plus a tail, published, then extended (and every other one repeated).

A block-granular cache reuses the k blocks; the ideal reuse includes the tail.
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import Step, StepList, Workload, WorkloadShape, random_tokens, workload_rng


@dataclass
class CrossBlock(Workload):
    name = "cross-block"
    description = "k blocks plus a tail, later extended or repeated"
    max_blocks: int = 3
    repeat_every: int = 2  # every n-th prompt is also sent again unchanged

    def steps(self, shape: WorkloadShape) -> list[Step]:
        rng = workload_rng(self.name, shape.seed)
        steps = StepList()
        block = shape.block_size
        max_blocks = max(1, min(self.max_blocks, (shape.max_prompt_tokens - 2 * block) // block))
        item = 0
        while steps.consumer_count < shape.requests:
            length = rng.randint(1, max_blocks) * block + rng.randint(1, block - 1)
            base = random_tokens(rng, length, shape.vocab_size)
            extension = random_tokens(rng, rng.randint(1, block), shape.vocab_size)
            published = steps.producer(base)
            steps.consumer(base + extension, shape.max_tokens, (published,), "extended")
            item += 1
            if item % self.repeat_every == 0 and steps.consumer_count < shape.requests:
                steps.consumer(base, shape.max_tokens, (published,), "repeated")
        return steps.steps
