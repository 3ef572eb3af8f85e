"""Chats: each turn's prompt is the previous prompt, the answer to it and a new user message.

The producer publishes turn t; the consumer serves turn t+1, whose ideal reuse is all of turn t
(it ends mid-block whenever turn t does). The answers are seeded tokens of the consumer's
generation length, not the model's own output, so that every prompt is known in advance.
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import Step, StepList, Workload, WorkloadShape, random_tokens, workload_rng


@dataclass
class MultiTurn(Workload):
    name = "multi-turn"
    description = "next prompt = previous prompt + answer + new message"
    turns_per_chat: int = 3  # consumer turns per conversation

    def steps(self, shape: WorkloadShape) -> list[Step]:
        rng = workload_rng(self.name, shape.seed)
        steps = StepList()
        block = shape.block_size
        while steps.consumer_count < shape.requests:
            turn = random_tokens(rng, rng.randint(8, 2 * block), shape.vocab_size)
            published = steps.producer(turn)
            for _ in range(self.turns_per_chat):
                answer = random_tokens(rng, shape.max_tokens, shape.vocab_size)
                message = random_tokens(rng, rng.randint(4, block), shape.vocab_size)
                next_turn = turn + answer + message
                if len(next_turn) > shape.max_prompt_tokens or steps.consumer_count >= shape.requests:
                    break
                steps.consumer(next_turn, shape.max_tokens, (published,), "next turn")
                turn = next_turn
                published = steps.producer(turn)
        return steps.steps
