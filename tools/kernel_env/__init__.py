# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The kernel-only GPU environment: ``stage`` copies the patched stock sources
the GPU tier needs into ``.device/stock``; ``shim`` serves them as ``vllm``
on a machine without vLLM. ``prepare.sh`` runs here, ``gpu_tier.sh`` there."""
