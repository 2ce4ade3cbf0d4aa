# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The indexer step driver: the patched ``sparse_attn_indexer_kpool`` driven
step after step as serving runs it, stage against stock, byte for byte.

- ``batches``: the scheduler and each step's attention metadata;
- ``model``: one model's DSA layers (``Side``) and ``build_stage``, the one
  function that knows the stage API;
- ``refs``: torch stand-ins for DeepGEMM's logits and the CUDA top-k;
- ``steps``: the driver (``Config``, ``Run``, ``run``);
- ``timing``: the per-layer timing of a step, stock against the stage.

Import it once vLLM is importable (the test overlay, or the kernel-only shim:
``tools/indexer_steps.py`` sets either up); the tests import it from here.
"""
