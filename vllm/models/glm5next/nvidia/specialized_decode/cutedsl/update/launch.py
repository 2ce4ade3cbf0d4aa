# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The host side of ``KpoolUpdate``: what it takes, its compile key, its launch."""

from dataclasses import dataclass

import cutlass.cute as cute
import torch

from ...constants import DIM, POOL
from ..common.host import (
    INDEX_TYPES,
    KpoolKernel,
    check_devices,
    check_pool_size,
    fake,
    kernel_launcher,
    layout,
    mismatch,
)
from .kernel import KpoolUpdate

# The tensor arguments, in order.
TENSORS = ("kv_cache", "tail_kv_cache", "tail_slot_mapping", "key", "slot_score")
TENSORS += ("ape", "slot_mapping", "positions")


def check(tensors: tuple, pool_size, head_dim) -> None:
    """What ``KpoolUpdate``'s 4- and 8-byte accesses and its warp per request
    take of ``tensors`` (``TENSORS``), ``pool_size``, ``head_dim``."""
    check_devices(TENSORS, *tensors)
    kv_cache, tail, _, key, slot_score, ape = tensors[:6]
    if head_dim != DIM:
        raise mismatch("head_dim", str(DIM), head_dim)
    check_pool_size(pool_size)
    cache = kv_cache.stride()
    if (
        kv_cache.dtype is not torch.uint8
        or len(cache) != 3
        or cache[2] != 1
        or cache[0] % 4
        or kv_cache.data_ptr() % 4
    ):
        expected = "uint8 [blocks, page, bytes], 4-byte aligned pages"
        raise mismatch("kv_cache", expected, layout(kv_cache))
    shape, stride = tail.shape, tail.stride()
    if (
        tail.dtype is not torch.bfloat16
        or len(shape) != 4
        or shape[1] != 2
        or shape[2] % POOL
        or shape[3] != DIM
        or stride[3] != 1
        or stride[2] != DIM
        or stride[1] % 4
        or stride[0] % 4
        or tail.data_ptr() % 8
    ):
        expected = "bf16 [blocks, 2, ring, 128], ring a multiple of 4, 8-byte "
        raise mismatch("tail_kv_cache", expected + "aligned rows", layout(tail))
    rows = key.shape
    if key.dtype is not torch.bfloat16 or len(rows) != 3 or rows[2] != DIM:
        raise mismatch("key", "bf16 [requests, tokens, 128]", layout(key))
    for name, t in (("key", key), ("slot_score", slot_score)):
        stride = t.stride()
        if (
            t.dtype is not torch.bfloat16
            or t.shape != rows
            or stride[2] != 1
            or stride[1] % 4
            or stride[0] % 4
            or t.data_ptr() % 8
        ):
            expected = "bf16 [requests, tokens, 128] as key, unit dim stride, "
            raise mismatch(name, expected + "8-byte aligned rows", layout(t))
    if (
        ape.dtype is not torch.float32
        or ape.shape != (POOL, DIM)
        or ape.stride() != (DIM, 1)
        or ape.data_ptr() % 16
    ):
        raise mismatch("ape", "a contiguous fp32 [4, 128]", layout(ape))
    tokens = rows[:2]
    for name in ("tail_slot_mapping", "slot_mapping", "positions"):
        t = tensors[TENSORS.index(name)]
        if t.dtype not in INDEX_TYPES or t.shape != tokens or not t.is_contiguous():
            expected = "a contiguous int32/int64 [requests, tokens]"
            raise mismatch(name, expected, layout(t))


class UpdateKernel(KpoolKernel["UpdateKernel.CompileKey"]):
    """``kpool_decode_update_and_maybe_write_cache_batched(kv_cache,
    tail_kv_cache, tail_slot_mapping, key, slot_score, ape, slot_mapping,
    positions, pool_size, head_dim, round_scale=)`` for ``head_dim`` 128;
    ``mx_scales`` is what the stock kernel reads from
    ``mqa_logits_use_mx_scales()`` (UE8M0 bytes, else FP32 scales). One
    compile key per cache layout, scale format and index dtypes."""

    @dataclass(frozen=True)
    class CompileKey:
        ring: int
        page: int
        page_bytes: int  # kv_cache.stride(0)
        tail_block: int  # tail_kv_cache.stride(0)
        tail_half: int  # tail_kv_cache.stride(1)
        mx_scales: bool
        round_scale: bool
        tail_slots_dtype: torch.dtype
        slots_dtype: torch.dtype
        positions_dtype: torch.dtype

    kernel = KpoolUpdate

    def spec(
        self,
        kv_cache: torch.Tensor,
        tail_kv_cache: torch.Tensor,
        tail_slot_mapping: torch.Tensor,
        key: torch.Tensor,
        slot_score: torch.Tensor,
        ape: torch.Tensor,
        slot_mapping: torch.Tensor,
        positions: torch.Tensor,
        pool_size: int,
        head_dim: int = DIM,
        *,
        mx_scales: bool,
        round_scale: bool = True,
    ):
        tensors = (kv_cache, tail_kv_cache, tail_slot_mapping, key, slot_score, ape)
        tensors += (slot_mapping, positions)
        check(tensors, pool_size, head_dim)
        tail = tail_kv_cache
        fields = dict(ring=tail.shape[2], page=kv_cache.shape[1])
        fields |= dict(page_bytes=kv_cache.stride(0), tail_block=tail.stride(0))
        fields |= dict(tail_half=tail.stride(1), mx_scales=bool(mx_scales))
        fields |= dict(round_scale=bool(round_scale), positions_dtype=positions.dtype)
        fields |= dict(tail_slots_dtype=tail_slot_mapping.dtype)
        compile_key = self.dispatch(**fields, slots_dtype=slot_mapping.dtype)
        requests, tokens = key.shape[:2]
        return compile_key, tensors if requests and tokens else None, None

    __call__ = kernel_launcher(spec)

    def warmup_inputs(self, compile_key: CompileKey) -> tuple:
        requests, tokens = cute.sym_int(), cute.sym_int()
        rows = (requests, tokens)

        def indices(dtype):
            return fake(dtype, rows, (cute.sym_int64(), 1))

        def rows_of_dims():
            stride = (cute.sym_int64(divisibility=4), cute.sym_int64(divisibility=4))
            return fake(torch.bfloat16, (*rows, DIM), (*stride, 1), 8)

        k = compile_key
        shape = (cute.sym_int(), k.page, cute.sym_int())
        stride = (cute.sym_int64(divisibility=4), cute.sym_int64(), 1)
        cache = fake(torch.uint8, shape, stride)
        shape = (cute.sym_int(), 2, k.ring, DIM)
        stride = (cute.sym_int64(divisibility=4), cute.sym_int64(divisibility=4))
        tail = fake(torch.bfloat16, shape, (*stride, DIM, 1), 8)
        ape = fake(torch.float32, (POOL, DIM), (DIM, 1), 16)
        return (
            cache,
            tail,
            indices(k.tail_slots_dtype),
            rows_of_dims(),
            rows_of_dims(),
            ape,
            indices(k.slots_dtype),
            indices(k.positions_dtype),
        )


UPDATE = UpdateKernel()
