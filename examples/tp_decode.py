"""Launcher example: one MLA decode layer sharded over the GPUs of one host.

    torchrun --nproc_per_node=2 examples/tp_decode.py

Every rank builds the same full weights and inputs (same seed), keeps its
shard of the heads, and runs a few decode steps; y is complete on every rank."""

import os

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from mla_decode.reference import generate_input  # noqa: E402
from mla_decode.tp import TPDecoder  # noqa: E402


def main():
    dist.init_process_group("nccl")  # RCCL on ROCm builds of PyTorch
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    config, x, kv = generate_input(batch_size=8, prefill=256, seed=0, device="cuda")
    dec = TPDecoder(config, rank, world)
    for step in range(4):
        y, _ = dec(x, kv)
        if rank == 0:
            print(f"step {step}: cache length {kv.seq_len}, |y| = {y.float().norm().item():.4f} "
                  f"({dec.last_backend}, TP={world})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
