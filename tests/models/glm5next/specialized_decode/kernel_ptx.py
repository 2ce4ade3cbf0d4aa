# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The CPU compile of the CuTe DSL kernels: each compile key's kernel
compiled for sm_90a or sm_100a on its ``warmup_inputs`` (fake tensors, no
GPU) as the JIT warmup compiles it, and its PTX read by instruction."""

import importlib.util
import re
import subprocess
import tempfile
from collections import Counter
from pathlib import Path

import cutlass.cute as cute

from vllm.model_executor.warmup.jit_warmup_cutedsl_helper import cutedsl_fake_stream

ARCHS = ["sm_90a", "sm_100a"]


def compile_ptx(kernel, key, arch: str) -> str:
    """PTX of ``kernel``'s variant ``key`` compiled as the warmup compiles it
    (TVM-FFI, an environment stream, the warmup's fake tensors) for
    ``arch``."""
    with tempfile.TemporaryDirectory() as dump:
        options = f"--enable-tvm-ffi --keep-ptx --dump-dir {dump} --gpu-arch {arch}"
        compiled = cute.compile(
            kernel.kernel(key),
            *kernel.warmup_inputs(key),
            cutedsl_fake_stream(),
            options=options,
        )
        return compiled.__ptx__


def _ptxas(ptx: str, arch: str) -> str:
    """ptxas's ``-v`` report of ``ptx`` assembled for ``arch`` (the ptxas
    of nvidia-cuda-nvcc, which vLLM's torch pins)."""
    (toolkit,) = importlib.util.find_spec("nvidia.cu13").submodule_search_locations
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp, "kernel.ptx")
        source.write_text(ptx)
        done = subprocess.run(
            [Path(toolkit, "bin", "ptxas"), f"-arch={arch}", "-v", source]
            + ["-o", Path(tmp, "kernel.cubin")],
            capture_output=True,
            text=True,
            check=True,
        )
    return done.stderr


def entry_resources(ptx: str, arch: str) -> dict[str, tuple[int, int]]:
    """Each kernel of ``ptx`` (its entry name) -> (registers a thread,
    bytes spilled), as ptxas assembles it for ``arch``."""
    found = {}
    for part in _ptxas(ptx, arch).split("Compiling entry function '")[1:]:
        name = part[: part.index("'")]
        registers = int(re.search(r"Used (\d+) registers", part)[1])
        spilled = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", part)
        found[name] = (registers, int(spilled[1]) + int(spilled[2]))
    return found


def resources(ptx: str, arch: str) -> tuple[int, int]:
    """(registers a thread, bytes spilled) of ``ptx``'s one kernel."""
    (used,) = entry_resources(ptx, arch).values()
    return used


def ops(ptx: str) -> Counter:
    """Instruction counts of ``ptx``, inline-asm blocks and predicated
    instructions included."""
    return Counter(
        re.findall(r"(?:^|[{;])\s*(?:@!?%?\w+\s+)?([a-z][\w.:]*)", ptx, re.M)
    )


def constants(ptx: str) -> set[str]:
    """The FP32 immediates of ``ptx``."""
    return set(re.findall(r"0f[0-9A-F]{8}", ptx))


def waits_once(ptx: str, triggers: int = 1) -> None:
    """The kernel waits once on its producer (PDL), lets its dependents
    launch ``triggers`` times (where its design says), spills nothing."""
    count = ops(ptx)
    assert count["griddepcontrol.wait"] == 1
    assert count["griddepcontrol.launch_dependents"] == triggers
    assert ".local" not in ptx, "spills to local memory"


def _definitions(ptx: str) -> dict[str, list[tuple[str, list[str]]]]:
    """Each register's defining instructions (op, operands) in ``ptx``."""
    defs: dict[str, list[tuple[str, list[str]]]] = {}
    line = r"^\s*(?:@!?%\w+\s+)?([a-z][\w.]*)\s+(%\w+),\s*([^;]*);"
    for op, dst, operands in re.findall(line, ptx, re.M):
        defs.setdefault(dst, []).append((op, [o.strip() for o in operands.split(",")]))
    return defs


def length_arithmetic(ptx: str) -> tuple[str, list[str]]:
    """The width of the trailing pool's division by 4 (``trunc_div``: a
    sign shift by 31 or 63, then by 30 or 62) and the ops that define the
    two operands of the add of length and offset it divides."""
    pattern = (
        r"shr\.s(32|64)\s+(%\w+),\s*(%\w+),\s*(?:31|63);"
        r"\s*shr\.u\1\s+%\w+,\s*\2,\s*(?:30|62);"
    )
    [(bits, _, dividend)] = re.findall(pattern, ptx)
    defs = _definitions(ptx)
    [(add, operands)] = [d for d in defs[dividend] if d[0].startswith("add.")]
    assert add == f"add.s{bits}"
    return bits, sorted(op for operand in operands for op, _ in defs[operand])
