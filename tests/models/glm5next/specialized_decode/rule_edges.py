# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The kernels' rules at their edges, for each ``test_<op>.py``'s rule tests
and ``tools/guard_table.py``.

Each kernel's valid arguments come from ``cases.py`` (a fixed seed, a
GLM-5-Next compile key); each edge changes one of them (``edges``): a
dimension of a tensor to one below, at and one above its own size and the
sizes the rules bound dimensions by (``landmarks``), the other dimensions
and the strides kept (a view of a fresh buffer), and for a contiguous
tensor also contiguous; an int scalar to its neighbours and the int32
edges; a tensor to float64, a list, the meta device, another device, None;
and the layouts of ``rule_layouts.py``. A test states what the rule must
answer (the argument it refuses, or None) and ``disagreements`` lists the
edges where it does not.

On the CPU ``check_devices`` refuses the CPU tensors before any rule reads
them: ``allow_cpu`` puts ``cpu_devices`` in its place, which takes CPU
tensors and still checks the type and the one device (an accommodation of
the tests: the product's check takes CUDA tensors only)."""

import contextlib
import functools
import random
import re
import sys
from pathlib import Path
from typing import Any, NamedTuple

import draws
import pytest
import torch
from rule_layouts import LAYOUTS, contiguous, like, span

import vllm.models.glm5next.nvidia.specialized_decode.cutedsl.expand.launch as expand
import vllm.models.glm5next.nvidia.specialized_decode.cutedsl.remap.launch as remap
import vllm.models.glm5next.nvidia.specialized_decode.cutedsl.scores.launch as scores
import vllm.models.glm5next.nvidia.specialized_decode.cutedsl.select.launch as select
import vllm.models.glm5next.nvidia.specialized_decode.cutedsl.upcast.launch as upcast
import vllm.models.glm5next.nvidia.specialized_decode.cutedsl.update.launch as update
from vllm.models.glm5next.nvidia.specialized_decode import cases
from vllm.models.glm5next.nvidia.specialized_decode.constants import (
    INT32_MAX,
    INT32_MIN,
    MAX_GROUPS,
)
from vllm.models.glm5next.nvidia.specialized_decode.cutedsl.common import host

LAUNCH_MODULES = (update, expand, remap, upcast, select, scores)
F64 = torch.float64
# The SMs the select's key and the scores' split are derived for on the CPU
# (an H100's, an H200's).
SMS = 132


def cpu_devices(names, *tensors, optional=()) -> None:
    """``check_devices`` that takes CPU tensors too: each of ``tensors``
    (None only where ``optional``) a torch.Tensor, on CUDA or the CPU, all on
    one device."""
    first = None
    for name, tensor in zip(names, tensors, strict=True):
        if tensor is None and name in optional:
            continue
        if not isinstance(tensor, torch.Tensor):
            raise host.mismatch(name, "a torch.Tensor", type(tensor).__name__)
        if tensor.device.type not in ("cuda", "cpu"):
            raise host.mismatch(name, "a CUDA tensor", f"a tensor on {tensor.device}")
        if first is None:
            first = tensor
        elif tensor.device != first.device:
            raise host.mismatch(
                name, f"a tensor on {first.device} as the others", tensor.device
            )


@contextlib.contextmanager
def allow_cpu():
    """The rules with ``cpu_devices`` (and the select's and the scores' SM
    counts) in place; without CUDA, DeepGEMM's scores are ``cpu_deep_gemm``
    (a scores case draws them)."""
    with pytest.MonkeyPatch.context() as patch:
        for module in (host, *LAUNCH_MODULES):
            patch.setattr(module, "check_devices", cpu_devices)
        for module in (select, scores):
            patch.setattr(module, "sm_count", lambda index: SMS)
        if not torch.cuda.is_available():
            patch.setattr(cases, "deep_gemm_scores", cpu_deep_gemm)
        yield


def cpu_deep_gemm(arguments: dict) -> torch.Tensor:
    """DeepGEMM's scores of a scores case on the CPU: the step simulator's
    stand-in (``indexer_sim.paged_logits``, one directory up)."""
    simulator = str(Path(__file__).resolve().parents[1])
    if simulator not in sys.path:
        sys.path.insert(0, simulator)
    from indexer_sim import paged_logits

    a = arguments
    return paged_logits(
        a["q"],
        a["kv_cache"],
        a["weights"],
        a["seq_lens"],
        a["block_table"],
        max_model_len=a["max_model_len"],
    )


# A GLM-5-Next deployment's keys: an 8-token tail ring, 64-token pages, the
# indexer's int32 positions and int64 slots; 512 pools in 2176 columns,
# 64-token MLA blocks; a 4096-pool select of k 512; the scores of the 16
# heads (views of vLLM's zero-padded 32), one draft token, 64-pool pages.
KEYS = {
    update.UPDATE: dict(
        ring=8,
        page=64,
        page_bytes=64 * 132,
        tail_block=2 * 8 * 128,
        tail_half=8 * 128,
        mx_scales=True,
        round_scale=True,
        tail_slots_dtype=torch.int64,
        slots_dtype=torch.int64,
        positions_dtype=torch.int32,
    ),
    expand.EXPAND: dict(groups=512, seq_lens_dtype=torch.int64, int32_lengths=True),
    remap.REMAP: dict(
        groups=512,
        width=2176,
        block_size=64,
        stride_rows=64,
        positions_dtype=torch.int64,
        int32_lengths=True,
        counts=True,
    ),
    upcast.UPCAST: {},
    select.SELECT: dict(k=512, dtype=torch.float32, rows=4, width=4096, sms=SMS),
    scores.SCORES: dict(heads=16, next_n=2, block=64),
}
# The kernels whose rules the edges below change argument by argument (the
# guard table's).
EDGED = list(KEYS)
# The seed of each kernel's base case: a few rows (the remap's: 8, 2 expanded;
# the select's: 23 of 4096 columns; the scores': 3 entries of up to 1270 pools).
SEEDS = {
    update.UPDATE: 7,
    expand.EXPAND: 4,
    remap.REMAP: 8,
    upcast.UPCAST: 5,
    select.SELECT: 17,
    scores.SCORES: 4,
}


@functools.cache
def base_case(kernel) -> cases.Case:
    """The kernel's valid case the edges change (drawn once, where the stock
    twins run: on CUDA if there is one, else on the CPU under Triton's
    interpreter; never modified)."""
    seed = SEEDS[kernel]
    extra = {"sms": SMS} if kernel is select.SELECT else {}
    key = kernel.dispatch(**KEYS[kernel])
    gen = torch.Generator("cuda" if torch.cuda.is_available() else "cpu")
    gen.manual_seed(seed)
    scales = draws.stock_scales(key.mx_scales) if kernel is update.UPDATE else nothing()
    on_cpu = cpu_scores() if gen.device.type == "cpu" else nothing()
    with scales, on_cpu:
        return cases.CASES[kernel](random.Random(seed), gen, key, **extra)


@contextlib.contextmanager
def cpu_scores():
    """DeepGEMM's scores as ``cpu_deep_gemm`` and the scores' SM count
    ``SMS``: a scores case drawn on the CPU."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cases, "deep_gemm_scores", cpu_deep_gemm)
        patch.setattr(scores, "sm_count", lambda index: SMS)
        yield


nothing = contextlib.nullcontext


def landmarks(kernel, a: dict) -> list[int]:
    """The sizes the rules of ``kernel`` bound dimensions by, for arguments
    ``a``: the rows a tensor follows, the columns an expansion takes, the
    remap's pool and width bounds, the select's k and widest row."""
    if kernel is expand.EXPAND:
        rows, groups = a["pool_ids"].shape
        return [rows, groups, groups * 4 + 3]
    if kernel is remap.REMAP:
        rows, groups = a["pool_ids"].shape
        width = a["out"].shape[1]
        extra = [32, MAX_GROUPS, 4096, 4096 + 128, 8192, (width - 3) // 4]
        return [rows, a["req_ids"].shape[0], groups * 4 + 3, *extra]
    if kernel is upcast.UPCAST:
        return [a["logits"].shape[0]]
    if kernel is select.SELECT:
        return [a["logits"].shape[0], a["k"], draws.SELECT_WIDEST]
    if kernel is scores.SCORES:
        return [*scores.HEADS, *scores.BLOCKS, max(scores.NEXT_N)]
    return []


# Int scalars' further edges: the select's largest k, the remap's block
# sizes (the pool, the largest int32 multiple of 4).
SCALARS = {"k": [1, select.MAX_K], "block_size": [4, INT32_MAX - 3]}


# An edge's answer that the test's own statement of the rule gives.
RULE = "the rule"


class Edge(NamedTuple):
    kernel: Any
    name: str  # what changed: "out[1]=2175", "k=0", "out: list"
    kind: str  # "base", "shape", "scalar", "dtype", "type" or "layout"
    arguments: dict
    expected: Any = RULE  # the argument refused, None (taken) or RULE


def valid(kernel, device="cpu") -> dict:
    """The base case's arguments, its tensors on ``device`` (zeros: the
    rules read no data)."""

    def zeros(value):
        if isinstance(value, tuple):
            return tuple(zeros(v) for v in value)
        return like(value, device=device) if isinstance(value, torch.Tensor) else value

    return {name: zeros(value) for name, value in base_case(kernel).arguments.items()}


class OnCuda(torch.Tensor):
    """A CPU tensor that says it is on CUDA device ``index`` (another
    device than the others' on a machine with one CUDA device or none)."""

    index = 1

    @property
    def is_cuda(self):
        return True

    @property
    def device(self):
        return torch.device("cuda", self.index)

    def get_device(self):
        return self.index


def on_cuda(index: int) -> torch.Tensor:
    tensor = torch.Tensor._make_subclass(OnCuda, torch.zeros(2))
    tensor.index = index
    return tensor


def edges(kernel, device="cpu") -> list[Edge]:
    """Every edge of ``kernel``'s base case, its tensors on ``device``:
    "shape" (a dimension, the strides kept, and of a contiguous tensor also
    contiguous), "scalar" (an int), "dtype" (a tensor in float64,
    which no rule takes), "type" (a tensor as a list, on the meta device, on
    another device than the others, None), "layout" (``LAYOUTS``)."""
    base = base_case(kernel).arguments
    valid_ = valid(kernel, device)
    marks = landmarks(kernel, base)
    found = [Edge(kernel, "base", "base", valid_)]

    def add(name, kind, argument, value, expected=RULE):
        found.append(Edge(kernel, name, kind, valid_ | {argument: value}, expected))

    def tensor_edges(name, value, wrap):
        """``value``'s edges, each as ``wrap`` puts it in the argument."""
        for dim, size in enumerate(value.shape):
            near = {m + d for m in (size, *marks) for d in (-1, 0, 1)}
            for n in sorted(near - {size}):
                shape = (*value.shape[:dim], n, *value.shape[dim + 1 :])
                if n < 0 or span(shape, value.stride()) > 1 << 24:
                    continue
                add(f"{name}[{dim}]={n}", "shape", name, wrap(like(value, shape=shape)))
                if dim and value.is_contiguous():  # and its strides
                    changed = wrap(contiguous(value, *shape))
                    add(f"{name}[{dim}]={n} contiguous", "shape", name, changed)
        add(f"{name}: float64", "dtype", name, wrap(like(value, dtype=F64)), name)
        add(f"{name}: list", "type", name, wrap([0]))
        add(f"{name}: meta", "type", name, wrap(like(value, device="meta")))
        if name != tensors[0]:
            add(f"{name}: another device", "type", name, wrap(on_cuda(1)))
        add(f"{name}: None", "type", name, wrap(None))

    tensors = [n for n, v in valid_.items() if isinstance(v, (torch.Tensor, tuple))]
    for name, value in valid_.items():
        if isinstance(value, torch.Tensor):
            tensor_edges(name, value, lambda t: t)
        elif isinstance(value, tuple):  # the scores' query: (values, scales)
            values, scales = value
            tensor_edges(name, values, lambda t, s=scales: (t, s))
            # Refused naming it, whatever the rest (declared, as a layout).
            add(f"{name}: values alone", "layout", name, values, name)
            scaled = (values, contiguous(values, *values.shape[:3]).float())
            add(f"{name}: with scales", "layout", name, scaled, name)
        elif isinstance(value, int) and not isinstance(value, bool):
            near = {value - 1, value + 1, 0, INT32_MIN - 1, INT32_MIN, INT32_MAX}
            near |= {INT32_MAX + 1, *SCALARS.get(name, [])}
            for n in [*sorted(near - {value}), True, float(value)]:
                add(f"{name}={n!r}", "scalar", name, n)
    for name, changes, expected in LAYOUTS[type(kernel).__name__](valid_):
        found.append(Edge(kernel, name, "layout", valid_ | changes, expected))
    return found


def devices_named(a: dict, names, optional=()) -> str | None:
    """What the device check names of ``a``'s tensor arguments ``names``:
    the first that is not a torch.Tensor (None where it is not
    ``optional``), not on CUDA or the CPU, or not on the first's device."""
    first = None
    for name in names:
        tensor = a[name]
        if tensor is None and name in optional:
            continue
        if not isinstance(tensor, torch.Tensor) or tensor.device.type not in (
            "cuda",
            "cpu",
        ):
            return name
        if first is None:
            first = tensor
        elif tensor.device != first.device:
            return name
    return None


def int32(value) -> bool:
    return isinstance(value, int) and INT32_MIN <= value <= INT32_MAX


def disagreements(kernel, expect, found) -> list[str]:
    """The edges of ``found`` whose answer is not ``expect(edge)`` (the
    test's own statement of the rule: the argument a refusal names, None
    where it takes them), or whose refusal does not say "argument: expected
    X, got Y"."""
    problems = []
    with allow_cpu():
        for edge in found:
            message = answer(kernel, edge.arguments)
            named = None if message is None else message.split(":", 1)[0]
            want = expect(edge)
            form = message is None or re.match(
                rf"{named}: expected .+, got .+", message
            )
            if named != want or not form:
                problems.append(f"{edge.name}: {message or 'taken'}; expected {want}")
    return problems


def shape_disagreements(kernel, rule) -> list[str]:
    """``disagreements`` of the edges the test's ``rule`` answers (of the
    edge's arguments): all but the declared ones and the tensors left None."""
    found = [
        e for e in edges(kernel) if e.expected is RULE and not e.name.endswith(": None")
    ]
    return disagreements(kernel, lambda edge: rule(edge.arguments), found)


def missing(kernel, name: str) -> list[str]:
    """``disagreements`` of ``name`` left None: refused, naming it."""
    found = [e for e in edges(kernel) if e.name == f"{name}: None"]
    assert found, name
    return disagreements(kernel, lambda edge: name, found)


def declared_disagreements(kernel) -> list[str]:
    """``disagreements`` of the edges that declare their answer: each
    tensor in float64, the layouts."""
    found = [e for e in edges(kernel) if e.expected is not RULE]
    return disagreements(kernel, lambda edge: edge.expected, found)


def answer(kernel, arguments: dict) -> str | None:
    """The rule's answer: the ``Refused`` message, or None where it takes
    the arguments."""
    try:
        kernel.spec(**arguments)
    except host.Refused as refusal:
        return str(refusal)
    return None
