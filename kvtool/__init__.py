"""kvtool: partial-tail KV offload for vLLM over a Mooncake store, with serve-pair, bench and inspect tools."""

__version__ = "0.1.0"
