# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""GLM-5-Next's sparse indexer shapes the kernels are written for, and the
bounds of their index arithmetic. Imports nothing (the settings read it
before vLLM is imported)."""

# Keys pooled per index entry (``index_kpool``): every kernel takes 4.
POOL = 4
# The index head dimension (``index_head_dim``); in FP8, one 128-byte
# swizzle row of the scores' tiles.
DIM = 128
# The most pools a top-k row selects that one CTA maps (a thread a pool).
MAX_GROUPS = 1024
ARCHITECTURES = ("Glm5NextForCausalLM", "Glm5NextForConditionalGeneration")
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
