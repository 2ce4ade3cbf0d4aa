# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""GLM-5-Next specialized decode on NVIDIA GPUs: CuTe DSL kernels for the
kpool sparse indexer's decode path, enabled by
``additional_config={"decode_backend": "latency_specialized"}``.
``kpool.py`` is the public module; docs/reference.md lists the files."""
