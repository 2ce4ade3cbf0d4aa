# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""GLM-5-Next specialized decode on NVIDIA GPUs: CuTe DSL kernels for the
kpool sparse indexer's decode path, enabled by
``additional_config={"decode_backend": "latency_specialized"}``.

- ``kpool.py``: the public module (the kernel functions, ``KpoolStage``,
  ``FusedRemap``);
- ``config.py``: the settings and requirements;
- ``cutedsl/<op>/``: one kernel each, its device code (``kernel.py``) and
  its host side (``launch.py``: what it takes, its compile key, its
  launch); ``cutedsl/common/``: device helpers and the shared host side;
- ``runtime/``: the stage (``stage.py``: routing and state;
  ``steps.py``: planned steps; ``remap.py``: the fused conversion), its
  installation and JIT warmup, and ``hook.py``: what patch 0002 calls;
- ``cases.py`` and ``self_check.py``: the kernels' randomized cases and the
  warmup's check against the stock kernels.
"""
