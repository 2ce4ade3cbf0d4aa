# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The stage's self-check at the JIT warmup: every compiled kernel variant
runs ``CASES`` cases of ``cases.py`` with the executor the stage would
launch, each written buffer compared byte for byte with what its stock twin
writes. Case N of seed S is drawn from seed S + N alone. One sync at the
end."""

import random

import torch

from .cases import CASES as DRAWS
from .cutedsl.common.host import Refused
from .cutedsl.select.launch import SELECT, sm_count

CASES = 64


def check(executors: dict, seed: int, device) -> str | None:
    """Runs ``CASES`` cases of each key of ``executors`` (key -> executor):
    the first case the rule refuses or that derives another key (neither
    launched), else the first that differs from stock's, or None."""
    results = []
    for key, executor in executors.items():
        kernel = next(k for k in DRAWS if isinstance(key, k.CompileKey))
        name = type(kernel).__name__
        for case in range(CASES):
            rng = random.Random(seed + case)
            gen = torch.Generator(device).manual_seed(seed + case)
            extra = {"sms": sm_count(device.index or 0)} if kernel is SELECT else {}
            drawn = DRAWS[kernel](rng, gen, key, **extra)
            where = f"{name} case {case} (seed {seed + case})"
            try:
                derived, args, _ = kernel.spec(**drawn.arguments)
            except Refused as error:
                return f"{where}: refused: {error}"
            if derived != key:
                return f"{where}: derives {derived}, not {key}"
            if args is not None:
                executor(*args)
            differs = [
                (got.view(torch.uint8) != want.view(torch.uint8)).any()
                for got, want in zip(drawn.written, drawn.expected, strict=True)
            ]
            results.append((where, key, torch.stack(differs).any()))
    if not results:
        return None
    bad = torch.stack([r[2] for r in results]).tolist()  # the one sync
    for (where, key, _), differs in zip(results, bad, strict=True):
        if differs:
            return f"{where} differs from stock: {key}"
    return None
