"""A disaggregated conversation: the producer prefills each turn, the consumer answers it.

Turn t's prompt P_t goes to the producer with ``max_tokens=1`` (it computes and publishes P_t),
then to the consumer, which generates the answer A_t. The next turn is P_t + A_t + a new user
message: the model's real answer, so the prompt is known only once the consumer answered (the
steps name it through their ``history``). A consumer that saves prompt + answer at request end
lets the producer reuse all of P_t + A_t but its last token; one that does not leaves it P_t.

Both engines' hits are measured, against everything either engine computed before (the runner
feeds the oracle as the run goes). P_0 ends mid-block, as in the other workloads.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from .base import Ref, Step, StepList, Workload, WorkloadShape, random_tokens, workload_rng


@dataclass
class Chat(Workload):
    name = "chat"
    description = "a conversation: producer prefills each turn, consumer answers; next turn adds the real answer"
    turns_per_chat: int = 3  # consumer answers per conversation, when the engine's limit allows

    def steps(self, shape: WorkloadShape) -> list[Step]:
        rng = workload_rng(self.name, shape.seed)
        steps = StepList()
        while steps.consumer_count < shape.requests:
            self._conversation(steps, rng, shape)
        return steps.steps

    def _conversation(self, steps: StepList, rng: random.Random, shape: WorkloadShape) -> None:
        """One conversation of up to ``turns_per_chat`` turns, each a prefill and an answer.

        ``longest`` bounds the turn's prompt (answers at most ``max_tokens``), so that no prompt the
        run resolves can exceed what the engine takes."""
        block = shape.block_size
        first = rng.randint(0, 1) * block + rng.randint(1, block - 1)
        message = random_tokens(rng, max(1, min(first, shape.max_prompt_tokens)), shape.vocab_size)
        history: tuple[Ref, ...] = ()
        depends_on: tuple[int, ...] = ()
        longest = len(message)
        for _ in range(self.turns_per_chat):
            prefill = steps.producer(message, label="prefill", depends_on=depends_on, history=history)
            answer = steps.consumer((), shape.max_tokens, (prefill,), "answer", history=(Ref(prefill, "prompt"),))
            message = random_tokens(rng, rng.randint(4, block), shape.vocab_size)
            longest += shape.max_tokens + len(message)
            if steps.consumer_count >= shape.requests or longest > shape.max_prompt_tokens:
                return
            history, depends_on = (Ref(answer, "prompt"), Ref(answer, "answer")), (answer,)
