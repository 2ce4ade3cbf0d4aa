# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The GPU fuzz loops' draws: a compile key of each kernel, from few
layouts (so that a run compiles few variants), and its case from
``cases.py`` (the self-check's); ``about``, a case's shapes for a failure
message; ``stock_scales``, the scale format stock's update writes."""

import random
from unittest import mock

import torch

from vllm.models.glm5next.nvidia.ops import kpool_compress
from vllm.models.glm5next.nvidia.specialized_decode import cases
from vllm.models.glm5next.nvidia.specialized_decode.constants import DIM
from vllm.models.glm5next.nvidia.specialized_decode.cutedsl.expand.launch import EXPAND
from vllm.models.glm5next.nvidia.specialized_decode.cutedsl.remap.launch import REMAP
from vllm.models.glm5next.nvidia.specialized_decode.cutedsl.select import kernel, launch
from vllm.models.glm5next.nvidia.specialized_decode.cutedsl.upcast.launch import UPCAST
from vllm.models.glm5next.nvidia.specialized_decode.cutedsl.update.launch import UPDATE

INDICES = (torch.int32, torch.int64)
# (ring, page, page padding bytes, half and block padding elements): 12 and
# 48 are not powers of two.
LAYOUTS = ((4, 64, 0, 0, 0), (8, 16, 16, 0, 0), (16, 32, 4, 8, 512))
LAYOUTS += ((12, 48, 8, 4, 128),)
# (pools, row width): GLM-5-Next's 512 pools in 2176 columns, the extremes
# (992 pools fill 4096 columns; 1024 need 8192, one tile with counts) and
# slack; rows are whole stock tiles of 128 columns, which stock compacts in
# column order with counts.
REMAP_SHAPES = ((32, 256), (96, 512), (512, 2176), (512, 2560), (992, 4096))
REMAP_SHAPES += ((1024, 8192),)
# (block size, rows between blocks): not powers of two, strides past the size.
BLOCKS = ((4, 4), (12, 12), (16, 48), (48, 52), (64, 64), (64, 128), (256, 256))
# The cluster choice's edges (1 CTA below 16384 columns, 16 from 131072 at
# few rows), odd widths, the widest the kernel takes.
SELECT_WIDTHS = (1, 7, 511, 512, 513, 4096, 5000, 16384, 65536, 131080, 262144)
SELECT_WIDEST = launch.CLUSTERS[-1] * kernel.CAPACITIES[-1]
SELECT_ROWS = (1, 2, 3, 4, 8, 16, 33, 64, 256)


def stock_scales(mx: bool):
    """Stock's update writes MX scales (``mx``) or FP32 ones, as the
    process's ``mqa_logits_use_mx_scales()`` would say (a context)."""
    return mock.patch.object(kpool_compress, "mqa_logits_use_mx_scales", lambda: mx)


def update_key(rng: random.Random):
    """A cache layout of ``LAYOUTS``, a scale format (MX, whose rounding
    round_scale=False cannot turn off, or FP32 scales rounded or not), the
    index dtypes."""
    ring, page, page_pad, half_pad, block_pad = rng.choice(LAYOUTS)
    half = ring * DIM + half_pad
    layout = (ring, page, page * (DIM + 4) + page_pad, 2 * half + block_pad, half)
    scales = (rng.random() < 0.5, rng.random() < 0.5)
    index, positions = rng.choice(INDICES), rng.choice(INDICES)
    return UPDATE.CompileKey(*layout, *scales, index, index, positions)


def expand_key(rng: random.Random):
    """Pool counts that are zero, odd, GLM-5-Next's 512, the most (1024),
    any; both lengths dtypes and arithmetics."""
    groups = rng.choice([0, 1, 31, 32, 100, 512, 1024, rng.randint(1, 1024)])
    return EXPAND.CompileKey(groups, rng.choice(INDICES), rng.random() < 0.5)


def remap_key(rng: random.Random):
    """A top-k shape of ``REMAP_SHAPES``, a KV block layout of ``BLOCKS``,
    with or without counts; ``int32_lengths`` (the fused remap's) of the
    model runner's int64 positions, else either dtype."""
    int32_lengths = rng.random() < 0.5
    dtype = torch.int64 if int32_lengths else rng.choice(INDICES)
    shape = (*rng.choice(REMAP_SHAPES), *rng.choice(BLOCKS))
    return REMAP.CompileKey(*shape, dtype, int32_lengths, rng.random() < 0.5)


def update_case(rng: random.Random, gen) -> cases.Case:
    key = update_key(rng)
    with stock_scales(key.mx_scales):
        return cases.update_case(rng, gen, key)


def expand_case(rng: random.Random, gen) -> cases.Case:
    return cases.expand_case(rng, gen, expand_key(rng))


def remap_case(rng: random.Random, gen) -> cases.Case:
    return cases.remap_case(rng, gen, remap_key(rng))


def upcast_case(rng: random.Random, gen) -> cases.Case:
    return cases.upcast_case(rng, gen, UPCAST.dispatch())


def select_case(rng: random.Random, gen, sms: int) -> cases.Case:
    """A drawn k (GLM-5-Next's 512 mostly), dtype and shape (widths 1 to
    851,968, 1-256 rows, at most 2^23 logits: the reference sorts them)."""
    width = rng.choice([*SELECT_WIDTHS, SELECT_WIDEST, rng.randint(1, 70_000)])
    rows = rng.choice([*SELECT_ROWS, rng.randint(1, 256)])
    rows = max(1, min(rows, (1 << 23) // width))
    dtype = rng.choice([torch.float32, torch.bfloat16])
    k = rng.choice([512, 512, 512, 1, 2048])
    key = launch.SELECT.dispatch(k=k, dtype=dtype, rows=rows, width=width, sms=sms)
    return cases.select_rows_case(rng, gen, key, rows, width)


def about(case: cases.Case) -> str:
    """The case's tensor arguments' shapes and strides, its scalars."""
    parts = []
    for name, value in case.arguments.items():
        if isinstance(value, torch.Tensor):
            value = f"{str(value.dtype)[6:]}{list(value.shape)}/{list(value.stride())}"
        parts.append(f"{name}={value}")
    return ", ".join(parts)
