"""mla_decode: one decode step of DeepSeek-V3/R1 Multi-head Latent Attention.

    y, cache = mla_decode.custom_kernel((config, x, kv_cache))

``mla_decode.backend()`` says which implementation runs and why.
"""

from ._ext import backend, kernels_built, kernels_usable
from .attention import attention_reference, mla_attention, mla_combine, rope_table, splits_possible
from .decoder import Dims, MLADecoder, MLAInputError, custom_kernel, release_cached
from .serving import flash_mla_with_kvcache, get_mla_metadata
from .dcp import dcp_attention, dcp_global_positions, dcp_local_lengths, dcp_shard_cache, merge_attention_states
from . import reference, roofline

__version__ = "0.2.0"

__all__ = [
    "backend", "kernels_built", "kernels_usable", "custom_kernel", "MLADecoder", "MLAInputError", "Dims", "release_cached",
    "mla_attention", "mla_combine", "attention_reference", "rope_table", "splits_possible", "reference", "roofline",
    "get_mla_metadata", "flash_mla_with_kvcache",
    "merge_attention_states", "dcp_local_lengths", "dcp_global_positions", "dcp_shard_cache", "dcp_attention",
]
