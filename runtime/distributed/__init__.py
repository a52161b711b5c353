"""Tensor parallelism over torch.distributed (gloo on CPU, NCCL on CUDA)."""
