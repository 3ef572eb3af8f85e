"""Disaggregated prefill: the producer computes a prompt with max_tokens=1, the consumer continues it.

The consumer sends the same prompt; the ideal reuse is all but its last token, whether or not the
prompt fills its last block. A producer that publishes only when decoding ends would publish nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import Step, StepList, Workload, WorkloadShape, random_tokens, workload_rng


@dataclass
class MaxTokensOne(Workload):
    name = "max-tokens-1"
    description = "producer requests with max_tokens=1 followed by consumer continuations"
    max_blocks: int = 4

    def steps(self, shape: WorkloadShape) -> list[Step]:
        rng = workload_rng(self.name, shape.seed)
        steps = StepList()
        longest = max(2, min(self.max_blocks * shape.block_size, shape.max_prompt_tokens))
        for _ in range(shape.requests):
            prompt = random_tokens(rng, rng.randint(2, longest), shape.vocab_size)
            published = steps.producer(prompt, max_tokens=1, label="prefill")
            steps.consumer(prompt, shape.max_tokens, (published,), "continuation")
        return steps.steps
