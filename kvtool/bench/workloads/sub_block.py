"""Prompts shorter than one block, published by the producer, then extended on the consumer.

A block-granular cache keeps nothing of such a prompt; the ideal reuse is the whole of it.
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import Step, StepList, Workload, WorkloadShape, random_tokens, workload_rng


@dataclass
class SubBlock(Workload):
    name = "sub-block"
    description = "prompts shorter than one block, later extended"

    def steps(self, shape: WorkloadShape) -> list[Step]:
        rng = workload_rng(self.name, shape.seed)
        steps = StepList()
        block = shape.block_size
        for _ in range(shape.requests):
            base = random_tokens(rng, rng.randint(1, block - 1), shape.vocab_size)
            extension = random_tokens(rng, rng.randint(1, block), shape.vocab_size)
            published = steps.producer(base)
            steps.consumer(base + extension, shape.max_tokens, (published,), "extended")
        return steps.steps
