"""Groups of prompts sharing a system prompt whose length ends mid-block, each with its own question.

The producer publishes the first member of each group; the consumer asks the others. The ideal
reuse is the whole system prompt. A connector that stores a prompt's full blocks and its end
boundary reaches only the system prompt's full blocks here (the members diverge inside the
published tail), so its efficiency is below 1 by design of the workload, not by a fault.
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import Step, StepList, Workload, WorkloadShape, random_tokens, workload_rng


@dataclass
class SharedPrefix(Workload):
    name = "shared-prefix"
    description = "groups sharing a system prompt that ends mid-block, each with its own question"
    members_per_group: int = 3  # consumer requests per group
    max_system_blocks: int = 2

    def steps(self, shape: WorkloadShape) -> list[Step]:
        rng = workload_rng(self.name, shape.seed)
        steps = StepList()
        block = shape.block_size
        while steps.consumer_count < shape.requests:
            system = random_tokens(
                rng, rng.randint(0, self.max_system_blocks) * block + rng.randint(1, block - 1), shape.vocab_size
            )

            def question() -> tuple[int, ...]:
                return random_tokens(rng, rng.randint(4, block), shape.vocab_size)

            published = steps.producer(system + question())
            for _ in range(min(self.members_per_group, shape.requests - steps.consumer_count)):
                steps.consumer(system + question(), shape.max_tokens, (published,), "member")
        return steps.steps
