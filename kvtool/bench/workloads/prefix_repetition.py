"""The shape of vLLM's ``prefix_repetition`` benchmark dataset: ``num_prefixes`` random prefixes of
``prefix_len`` tokens, each prompt one of them plus ``suffix_len`` random tokens, ``output_len``
generated tokens (here the consumer's generation length).

The producer publishes the first prompt of each prefix; the consumer sends the rest, shuffled.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

from .base import Step, StepList, Workload, WorkloadShape, random_tokens, workload_rng


class PrefixRepetitionOptions(BaseModel):
    """Its flags of ``kvtool bench``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    prefix_len: int = Field(default=80, gt=0, description="tokens of each shared prefix")
    suffix_len: int = Field(default=24, gt=0, description="tokens after the prefix")
    num_prefixes: int = Field(default=2, gt=0, description="distinct prefixes")


_DEFAULT = PrefixRepetitionOptions()


@dataclass
class PrefixRepetition(Workload):
    name = "prefix-repetition"
    description = "vLLM's prefix_repetition dataset: prefix len, suffix len, num prefixes, output len"
    Options = PrefixRepetitionOptions
    prefix_len: int = _DEFAULT.prefix_len
    suffix_len: int = _DEFAULT.suffix_len
    num_prefixes: int = _DEFAULT.num_prefixes

    def steps(self, shape: WorkloadShape) -> list[Step]:
        rng = workload_rng(self.name, shape.seed)
        steps = StepList()
        prefixes = [random_tokens(rng, self.prefix_len, shape.vocab_size) for _ in range(self.num_prefixes)]

        def suffix() -> tuple[int, ...]:
            return random_tokens(rng, self.suffix_len, shape.vocab_size)

        publishers = [steps.producer(prefix + suffix()) for prefix in prefixes]
        owners = [i % self.num_prefixes for i in range(shape.requests)]
        rng.shuffle(owners)
        for owner in owners:
            steps.consumer(prefixes[owner] + suffix(), shape.max_tokens, (publishers[owner],), "repeated prefix")
        return steps.steps
