#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Builds the fork wheel: ``python setup.py bdist_wheel [options]``.

This is not a setuptools project. The fork wheel is the pinned stock vLLM
wheel with the patch set applied and a local version, built by
``tools/build_wheel.py`` (``make wheel`` runs the same); ``bdist_wheel``
passes its options through (``--wheel STOCK.whl``, ``-d/--dist-dir DIR``,
``--help``). Any other command (install, develop, sdist, ``pip install .``)
is refused: install ``dist/vllm-*.whl`` with pip instead.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tools import build_wheel  # noqa: E402

if __name__ == "__main__":
    if sys.argv[1:2] != ["bdist_wheel"]:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    sys.exit(build_wheel.main(sys.argv[2:]))
