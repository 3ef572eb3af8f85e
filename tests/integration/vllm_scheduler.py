"""vLLM's own scheduler, with the kvtool connector on its scheduler side, driven step by step.

No model runs: each step's "forward pass" samples a fixed token for every request whose prompt is
computed, which is all vLLM's scheduler needs to move requests along (prefill, decode, stop, resume a
streaming-input session). What the connector decides along the way (lookups, the saves it plans and
their keys) goes through vLLM's real code paths: ``Scheduler.schedule``, ``update_from_output``,
``add_request``, ``_update_request_as_session``, ``finish_requests``.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import torch

from connector.data import KVToolMetadata, RequestSave

BLOCK_SIZE = 32
SAMPLED_TOKEN = 7  # every decode step samples this id
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")


@dataclass
class DrivenScheduler:
    scheduler: object
    saves: list[RequestSave] = field(default_factory=list)
    finished: dict[str, dict] = field(default_factory=dict)  # request id -> kv_transfer_params

    @property
    def side(self):
        """The connector's scheduler side (connector.scheduler.scheduler.SchedulerSide)."""
        return self.scheduler.connector._scheduler

    @property
    def namespace(self) -> str:
        return self.scheduler.connector.namespace.key_component()

    def step(self) -> object:
        """One scheduler step and its fake forward pass; returns the scheduler output."""
        from vllm.v1.outputs import ModelRunnerOutput

        output = self.scheduler.schedule()
        meta = output.kv_connector_metadata
        if isinstance(meta, KVToolMetadata):
            self.saves.extend(meta.saves)
        req_ids = list(output.num_scheduled_tokens)
        sampled = []
        for req_id in req_ids:
            request = self.scheduler.requests[req_id]
            done = request.num_computed_tokens >= request.num_tokens
            sampled.append([SAMPLED_TOKEN] if done else [])
        runner = ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)}, sampled_token_ids=sampled
        )
        for outputs in self.scheduler.update_from_output(output, runner).values():
            for finished in outputs.outputs:
                if finished.finish_reason is not None:
                    self.finished[finished.request_id] = finished.kv_transfer_params or {}
        return output

    def run_until(self, done, steps: int = 3000) -> None:
        """Step until ``done()`` (lookups answer on a background thread: an idle step waits a little;
        a lookup answers, a miss at worst, within the connector's 2 s time-out)."""
        for _ in range(steps):
            if done():
                return
            output = self.step()
            if not output.num_scheduled_tokens:
                time.sleep(0.01)
        raise AssertionError("the scheduler did not get there")


def driven_scheduler(model_dir: str, master_address: str, role: str = "kv_both", **extra) -> DrivenScheduler:
    """A real vLLM scheduler for the tiny model with the kvtool connector against a real master."""
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    model = ModelConfig(model=model_dir, dtype="float32", max_model_len=512, seed=0)
    sched = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512, max_model_len=512, is_encoder_decoder=False)
    cache = CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True)
    cache.num_gpu_blocks = 64
    transfer = KVTransferConfig(
        kv_connector="KVToolConnector",
        kv_connector_module_path="connector.connector",
        kv_role=role,
        kv_connector_extra_config={"master_server_address": master_address, "global_segment_size": 0, **extra},
    )
    config = VllmConfig(
        model_config=model,
        scheduler_config=sched,
        cache_config=cache,
        kv_transfer_config=transfer,
        device_config=DeviceConfig("cpu"),
    )
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=2, head_size=32, dtype=torch.float32)
    kv_cache = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), spec)])
    scheduler = Scheduler(
        vllm_config=config,
        kv_cache_config=kv_cache,
        structured_output_manager=StructuredOutputManager(config),
        block_size=BLOCK_SIZE,
    )
    assert scheduler.connector is not None and scheduler.connector._store is not None, "the connector has no store"
    return DrivenScheduler(scheduler)


def new_request(request_id: str, tokens: list[int], max_tokens: int, **extra):
    """A request as vLLM's engine core makes one (with its prefix-cache block hasher)."""
    from vllm import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    # A copy: vLLM extends a session's prompt list in place.
    hasher = get_request_block_hasher(BLOCK_SIZE, hash_fn)
    return Request(request_id, list(tokens), params, None, block_hasher=hasher, **extra)
