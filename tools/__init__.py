# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Project tooling: the patch set (``patchset``) and the fork wheel builder
(``build_wheel``). Stdlib only; nothing here imports vLLM."""
