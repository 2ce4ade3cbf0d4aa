# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""GLM-5-Next specialized decode on NVIDIA GPUs: CuTe DSL kernels for the
kpool sparse indexer's decode path, enabled by
``additional_config={"decode_backend": "latency_specialized"}``.

- ``kpool.py``: the public module (the four kernel functions, ``KpoolStage``,
  ``FusedRemap``);
- ``install.py``: ``install()`` at model build and the process's registry of
  stages; ``config.py``: the settings and requirements;
- ``stage.py``: one engine's stage (planned steps in ``steps.py``, the fused
  conversion in ``fused_remap.py``); ``warmup.py`` and ``self_check.py``: its
  JIT warmup;
- ``*_kernel.py``: one kernel each (its arguments, rule and compile key,
  device code); ``jit.py``: how they compile and launch; ``ptx.py``: device
  helpers; ``constants.py``: the shared numbers and names.
"""
