"""Tensor parallelism on torch.distributed (gloo on CPU, NCCL on GPUs), launched with torchrun.

    plan.py    which rows and columns of each weight a rank holds; SplitError when heads cannot be divided
    shard.py   the transform: shard a built Transformer in place, then add its all-reduces and logit gather
    load.py    each rank reads only its shard of a safetensors or GGUF checkpoint
    group.py   the process group from torchrun's environment
    driver.py  rank 0 broadcasts each forward pass; the other ranks follow
    llm.py     ParallelLLM: the LLM API on top; cli.py: the `--tp` entry for generate, chat and serve
"""
from fastdecode.parallel.plan import ShardPlan, SplitError
from fastdecode.parallel.shard import install_collectives, shard_model

__all__ = ["ShardPlan", "SplitError", "install_collectives", "shard_model"]
