# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The numbers and names the kpool specialized decode shares: the model's
shapes the kernels are written for, the bounds of their index arithmetic, and
the deployment switches. Imports nothing (the kernel-only GPU environment
loads it)."""

# --- GLM-5-Next's sparse indexer ----------------------------------------------

# Keys pooled per index entry (``index_kpool``): every kernel takes 4.
POOL = 4
# The index head dimension (``index_head_dim``).
DIM = 128
# The most pools a top-k row selects that one CTA maps (a thread a pool).
MAX_GROUPS = 1024
ARCHITECTURES = ("Glm5NextForCausalLM", "Glm5NextForConditionalGeneration")

# --- Index arithmetic ---------------------------------------------------------

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1

# Device types the kernels launch on. The CPU routing tests add "cpu" to
# reach the launch spies; nothing else changes it.
KERNEL_DEVICE_TYPES = frozenset({"cuda"})

# --- Deployment switches (``additional_config``) --------------------------------

BACKEND_KEY = "decode_backend"
BACKEND = "latency_specialized"
BACKENDS = ("auto", BACKEND)
# The stages, by name; a deployment leaves some out with SKIP_KEY.
STAGE = "dsa_kpool"
STAGES = (STAGE,)
SKIP_KEY = "specialized_decode_skip"
# The warmup self-check: "on" (a mismatch keeps the stage off), "off"
# (skipped) or "strict" (a mismatch raises). The environment variable
# overrides the config; the seed variable replays a logged case.
SELF_CHECK_KEY = "specialized_decode_self_check"
SELF_CHECK_ENV = "VLLM_GLM5NEXT_KPOOL_SELF_CHECK"
SELF_CHECK_SEED_ENV = "VLLM_GLM5NEXT_KPOOL_SELF_CHECK_SEED"
SELF_CHECK_MODES = ("on", "off", "strict")
# The opt-in pool select (select_kernel.py): true runs our exact top-k in
# place of stock's in deferring steps, the same set in ascending pool order
# (bytes differ from stock's: its order is its atomics'). Default false.
SELECT_KEY = "kpool_select"
CONFIG_KEYS = (BACKEND_KEY, SKIP_KEY, SELF_CHECK_KEY, SELECT_KEY)
