# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The GPU tier on a GPU machine without vLLM (torch, triton, CUDA; vLLM not
installed): ``stage`` copies the patched stock sources the tier needs into
``.device/stock``; ``shim`` serves them as ``vllm`` there. ``prepare.sh``
runs where vLLM is installed, ``gpu_tier.sh`` on the GPU machine."""
