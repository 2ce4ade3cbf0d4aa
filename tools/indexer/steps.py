# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Drives the real patched ``sparse_attn_indexer_kpool`` step after step as
serving does, on models (``model.Side``) fed the same inputs: ``stock``
(``SPECIALIZED_KPOOL = None``) and ``stage`` (its ``KpoolStage`` in a
``KpoolStages`` registry, as ``install()`` builds it), and compares them byte
for byte after every step. With ``Config(stages=2)`` a second engine's model
(``stage 2``: its own top-k buffer, stage and pool buffer, the same registry)
runs too: per layer, between one stage's defer and its conversion, the other
stage's whole layer step runs and its pool buffer is poisoned, so a stage
that read the other's buffer (or hand-off) differs from stock.

A step (``batches``) runs, per DSA layer: the step's inputs copied
into the layer's static buffers, the indexer (stock prefill and mixed paths,
the stage in planned steps), the index group's ready event, and the top-k
conversion as the backend path consumes it. Modes: ``eager``; ``full``
(uniform decode batches padded to a captured size, one CUDA graph per size
and model, captured after the size's first, eager step and replayed after);
``piecewise`` (breakable graphs per padded token count, the indexer and the
conversion eager breaks rerun at replay in the step's forward context; other
steps eager). DeepGEMM and the CUDA top-k are ``refs`` on both sides.

Compared after every step, per layer: the whole FP8 index cache and tail
cache, the physical top-k rows and counts the conversion returned, and the
logical top-k rows wherever a consumer read them. Logical rows are poisoned
before each layer; stage rows still all poison after the conversion were
handed to the fused remap (no consumer read them): counted as ``fused``;
``deferred`` counts the layer-steps whose indexer left them unwritten (the
stage's defer; declined by the remap, they are materialized and compared);
``launches`` counts the stage's launches of each compiled kernel (0 on the
CPU, where the rules refuse CPU tensors and every kernel runs its stock twin).
"""

import contextlib
import functools
import os
import random
import secrets
from collections import Counter
from dataclasses import asdict, dataclass, field
from types import SimpleNamespace

import torch

from tools.indexer.batches import (
    BACKENDS,
    Builder,
    Geometry,
    Scheduler,
    Step,
    Workload,
)
from tools.indexer.model import (
    POISON,
    Side,
    build_stage,
    count_launches,
    cpu_streams,
    mx_scales,
)
from tools.indexer.refs import TIE_BREAK, ContractTopk, Topk, references
from vllm.compilation.breakable_cudagraph import BreakableCUDAGraphCapture
from vllm.config import CUDAGraphMode
from vllm.forward_context import (
    BatchDescriptor,
    ForwardContext,
    override_forward_context,
)
from vllm.models.glm5next.nvidia import sparse_indexer
from vllm.models.glm5next.nvidia.specialized_decode.install import KpoolStages

POOL, D = 4, 128
MODES = ("eager", "full", "piecewise")
FIELDS = ("index cache", "tail cache", "physical top-k", "counts", "logical top-k")
# Every run's summary line, for the test session's terminal summary.
REPORTS: list[str] = []
# A few interpreted CPU steps (CI): a 128-token top-k (32 pools, the fewest
# the fused remap takes), prompts on both sides of it, next_n 1..4.
CPU_GEOMETRY = Geometry(
    layers=2, heads=4, topk=128, max_model_len=512, max_reqs=4, max_tokens=256
)
CPU_WORK = Workload(
    decode_steps=3, prompt=(96, 140), output=(4, 40), arrival=0.6,
    nonuniform=0.5, phase=1, tail_split="indexer",
)  # fmt: skip


def fuzz_seed() -> int:
    """``KPOOL_SEED`` to replay a run, else a fresh seed every run."""
    return int(os.environ.get("KPOOL_SEED") or secrets.randbits(31))


@dataclass
class Config:
    backend: str = "sm100"  # batches.BACKENDS
    mode: str = "eager"  # MODES
    geo: Geometry = field(default_factory=Geometry)
    work: Workload = field(default_factory=Workload)
    seed: int = 0
    # Stage models beside stock: 2 (eager only) interleaves two engines'.
    stages: int = 1
    # False (CPU): graph modes run each step eagerly in their forward context
    # (FULL: padded batch, capture-time metadata; piecewise: padded rows).
    capture: bool = True
    # CUDA: each stream held back this many cycles before each conversion
    # (outside FULL graphs), so a missing event or join shows as a mismatch.
    hold_cycles: int = 0
    # The opt-in select on the stage sides; stock's top-k is then its
    # contract's reference and the top-k rows compare as sets.
    select: bool = False
    full_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 24, 32)  # requests
    piecewise_sizes: tuple[int, ...] = (16, 32, 64, 128, 256, 512, 1024, 2048)
    max_reported: int = 20


@dataclass
class Report:
    name: str
    seed: int
    layers: int
    steps: Counter = field(default_factory=Counter)
    compared: int = 0  # buffers compared
    deferred: int = 0  # layer-steps whose indexer left the logical rows unwritten
    fused: int = 0  # ... and no consumer read them (the fused remap took them)
    planned: int = 0  # steps planned() took for the stage
    mismatches: int = 0
    details: list[str] = field(default_factory=list)
    max_context: int = 0
    requests: int = 0
    why_not_fused: list = field(default_factory=list)
    launches: Counter = field(default_factory=Counter)  # per kernel class

    def line(self) -> str:
        s = self.steps
        return (
            f"indexer steps {self.name}: {s['total']} steps ({s['decode_steps']} "
            f"with decodes: {s['decode']} decode-only, {s['mixed']} mixed; "
            f"{s['prefill']} prefill-only), {self.layers} layers, {self.requests} "
            f"requests, contexts up to {self.max_context}, {s['full_replay']} "
            f"FULL and {s['piecewise_replay']} piecewise replays, {self.planned} "
            f"planned, {self.deferred} deferred and {self.fused} fused layer-steps, "
            f"kernel launches {dict(sorted(self.launches.items()))}, "
            f"{self.compared} buffers compared, seed {self.seed}, "
            f"{self.mismatches} mismatches"
        )

    def as_dict(self) -> dict:
        return {
            **asdict(self),
            "steps": dict(self.steps),
            "launches": dict(self.launches),
            "summary": self.line(),
        }


def rows_as_sets(rows: torch.Tensor) -> torch.Tensor:
    """Each row's entries in ascending order: rows equal as sets compare
    equal."""
    return torch.sort(rows, dim=1).values


class Run:
    """Both models of one configuration (see the module docstring)."""

    def __init__(self, cfg: Config, device):
        if cfg.stages not in (1, 2) or (cfg.stages == 2 and cfg.mode != "eager"):
            raise ValueError(f"stages {cfg.stages} in mode {cfg.mode}: 1, or 2 eager")
        self.cfg, self.device = cfg, torch.device(device)
        geo = cfg.geo
        self.backend = BACKENDS[cfg.backend]
        self.prefixes = [
            tuple(
                f"model.layers.{i}.self_attn.{name}"
                for name in ("indexer.k_cache", "indexer.tail_cache", "attn")
            )
            for i in range(geo.layers)
        ]
        self.gen = torch.Generator(self.device).manual_seed(cfg.seed)
        init = self._initial_state()
        self.source = SimpleNamespace(**init["source"], positions=None)
        names = ("stock", "stage", "stage 2")[: 1 + cfg.stages]
        self.sides = [
            Side(name, geo, self.backend, self.prefixes, init, self.device)
            for name in names
        ]
        self.registry = KpoolStages()  # SPECIALIZED_KPOOL of the stage sides
        for side in self.sides:
            side.hold = cfg.hold_cycles if self.device.type == "cuda" else 0
        self.builder = Builder(geo, self.backend, self.prefixes, self.device)
        self.sched = Scheduler(geo, cfg.work, random.Random(cfg.seed))
        self.graphs: dict = {}
        self.hosts: dict = {}  # FULL graph key: its capture's Step.host
        cuda = self.device.type == "cuda"
        self.pool = torch.cuda.graph_pool_handle() if cuda else None
        self.stream = torch.cuda.Stream(self.device) if cuda else None
        self.stats: Counter = Counter()

    def _initial_state(self) -> dict:
        """Random caches (both models start from copies) and input buffers."""
        geo, g, dev = self.cfg.geo, self.gen, self.device

        def randn(*shape, dtype=torch.float32):
            return torch.randn(*shape, generator=g, device=dev).to(dtype)

        n, t = geo.layers, geo.max_tokens
        kv_shape = (geo.num_blocks, geo.page, D + 4)
        return dict(
            kv=[
                torch.randint(0, 256, kv_shape, generator=g, device=dev).to(torch.uint8)
                for _ in range(n)
            ],
            tail=[
                randn(geo.max_reqs + 1, 2, geo.ring, D, dtype=torch.bfloat16)
                for _ in range(n)
            ],
            ape=[randn(POOL, D) for _ in range(n)],
            source=dict(
                q=torch.zeros(n, t, geo.heads, D, device=dev).to(torch.float8_e4m3fn),
                k=torch.zeros(n, t, D, device=dev, dtype=torch.bfloat16),
                w=torch.zeros(n, t, geo.heads, device=dev),
                gate=torch.zeros(n, t, D, device=dev, dtype=torch.bfloat16),
            ),
        )

    def fill_inputs(self, rows: int) -> None:
        """Fresh random inputs for ``rows`` rows of every layer."""
        g, src, dev = self.gen, self.source, self.device
        shape = (self.cfg.geo.layers, rows)
        q = torch.randn(*shape, *src.q.shape[2:], generator=g, device=dev) * 8
        src.q[:, :rows] = q.to(torch.float8_e4m3fn)
        src.k[:, :rows] = torch.randn(*shape, D, generator=g, device=dev)
        src.w[:, :rows] = torch.randn(*shape, src.w.shape[2], generator=g, device=dev)
        src.gate[:, :rows] = torch.randn(*shape, D, generator=g, device=dev)

    def _how(self, batch) -> tuple[str, int, int]:
        """(mode, hidden rows, padding requests) of ``batch``."""
        cfg, tokens = self.cfg, batch.tokens
        if cfg.mode == "full" and batch.kind == "decode" and batch.uniform:
            q = batch.items[0].q_len
            sizes = [s for s in cfg.full_sizes if s >= len(batch.items)]
            if sizes and sizes[0] * q <= cfg.geo.capacity:
                return "full", sizes[0] * q, sizes[0] - len(batch.items)
        if cfg.mode == "piecewise":
            sizes = [s for s in cfg.piecewise_sizes if s >= tokens]
            if sizes and sizes[0] <= cfg.geo.max_tokens:
                return "piecewise", sizes[0], 0
        return "eager", tokens, 0

    def context(self, step: Step, mode: CUDAGraphMode, metadata="step"):
        return ForwardContext(
            no_compile_layers={},
            attn_metadata=step.metadata if metadata == "step" else metadata,
            slot_mapping={},
            cudagraph_runtime_mode=mode,
            batch_descriptor=BatchDescriptor(num_tokens=step.rows),
        )

    def _run_side(self, side: Side, step: Step, how: str) -> None:
        key, stage = (side.name, how, step.key), side is self.sides[1]
        if how == "full":  # a replay must see the host values of its capture
            captured = self.hosts.setdefault(key, step.host)
            if captured != step.host:
                raise AssertionError(
                    f"FULL graph {key} captured with host values {captured}, "
                    f"replayed for {step.host}: the graph key misses one"
                )
        if how == "eager" or not self.cfg.capture:
            mode = {"eager": "NONE", "full": "FULL", "piecewise": "PIECEWISE"}[how]
            ctx = self.context(step, CUDAGraphMode[mode])
            with override_forward_context(ctx):
                side.forward(self.source, step.rows)
        elif how == "full":
            graph = self.graphs.get(key)
            if graph is not None:
                graph.replay()
                self.stats["full_replay"] += stage
                return
            with override_forward_context(self.context(step, CUDAGraphMode.FULL)):
                side.forward(self.source, step.rows)  # the step; warms the kernels
            graph = self.graphs[key] = torch.cuda.CUDAGraph()
            ctx = self.context(step, CUDAGraphMode.FULL)
            with (
                torch.cuda.graph(graph, pool=self.pool, stream=self.stream),
                override_forward_context(ctx),
            ):
                side.forward(self.source, step.rows)
            self.stats["full_capture"] += stage
        else:
            capture = self.graphs.get(key)
            if capture is None:
                # Captured as vLLM captures: a profiling forward (no metadata),
                # whose eager breaks write nothing.
                capture = self.graphs[key] = BreakableCUDAGraphCapture(pool=self.pool)
                ctx = self.context(step, CUDAGraphMode.PIECEWISE, metadata=None)
                with override_forward_context(ctx), capture:
                    side.forward(self.source, step.rows)
                self.stats["piecewise_capture"] += stage
            with override_forward_context(self.context(step, CUDAGraphMode.PIECEWISE)):
                capture.replay()
            self.stats["piecewise_replay"] += stage

    def _planned(self, step: Step) -> bool:
        with override_forward_context(self.context(step, CUDAGraphMode.NONE)):
            return self.sides[1].stage.planned()

    def _compare(self, step: Step, index: int, report: Report) -> None:
        a, rows = self.sides[0], step.tokens
        counts = self.backend.convert != "group_no_counts"
        false = torch.zeros((), dtype=torch.bool, device=self.device)
        flags, where = [], []
        for b in self.sides[1:]:
            for layer in range(self.cfg.geo.layers):
                sa, sb = a.snap[layer], b.snap[layer]
                tail_a, tail_b = (s.tail[layer].view(torch.int16) for s in (a, b))
                where.append((b.name, layer))
                top = [(s.physical[:rows], s.logical[:rows]) for s in (sa, sb)]
                if self.cfg.select:  # the same sets, in the select's order
                    top = [[rows_as_sets(t) for t in side] for side in top]
                flags += [
                    (a.kv[layer] != b.kv[layer]).any(),
                    (tail_a != tail_b).any(),
                    (top[0][0] != top[1][0]).any(),
                    (sa.counts[:rows] != sb.counts[:rows]).any() if counts else false,
                    (top[0][1] != top[1][1]).any(),
                    (sb.logical[:rows] == POISON).all(),
                    b.deferred[layer],
                ]
        values = torch.stack(flags).view(-1, 7).tolist()
        for (side, layer), (*diffs, unread, deferred) in zip(
            where, values, strict=True
        ):
            report.fused += unread
            report.deferred += deferred
            report.compared += 4 + counts - unread
            for name, diff in zip(FIELDS, diffs, strict=True):
                if not diff or (name == "logical top-k" and unread):
                    continue
                report.mismatches += 1
                if len(report.details) < self.cfg.max_reported:
                    report.details.append(
                        f"step {index} ({step.kind}, {step.layout} rows, "
                        f"{step.rows} rows) {side} layer {layer}: {name} differs"
                    )

    def run(self) -> Report:
        cfg = self.cfg
        name = f"{cfg.backend}/{cfg.mode}/tail-{cfg.work.tail_split}"
        name += "/2 stages" if cfg.stages == 2 else ""
        name += "/select" if cfg.select else ""
        report = Report(name, cfg.seed, cfg.geo.layers, steps=self.stats)
        with contextlib.ExitStack() as stack:
            stack.enter_context(mx_scales(self.backend.mx))
            topk = ContractTopk if cfg.select else Topk
            stack.enter_context(references(sparse_indexer, self.device, topk=topk))
            if self.stream is None:
                stack.enter_context(cpu_streams())
            else:  # after the initial state, made on the default stream
                self.stream.wait_stream(torch.cuda.current_stream())
                stack.enter_context(torch.cuda.stream(self.stream))
            self.build_stages()
            stack.enter_context(count_launches(report.launches))
            for side in self.sides[1:]:
                report.why_not_fused += side.stage.why_not_fused
            index = 0
            while self.sched.decode_steps < cfg.work.decode_steps:
                self.step(index, report)
                index += 1
        report.requests = self.sched.rids
        return report

    def build_stages(self) -> None:
        """Each stage side's stage, in the run's registry."""
        for side in self.sides[1:]:
            side.stage = build_stage(
                side.attentions,
                self.cfg.geo.capacity,
                self.device,
                self.registry,
                select=self.cfg.select,
            )
            side.kpool = self.registry

    def _interleave(self, other: Side, step: Step, layer: int) -> None:
        """Between a stage's defer and its conversion of ``layer``: the other
        stage's whole step of the layer, then its pool buffer poisoned."""
        with other.active():
            other.forward_layer(self.source, layer, step.rows)
        other.stage.pool_buffer.fill_(POISON)

    def step(self, index: int, report: Report) -> None:
        batch = self.sched.schedule()
        how, rows, pad = self._how(batch)
        tail_split = self.cfg.work.tail_split
        step = self.builder.build(
            batch, rows=rows, full=how == "full", pad_reqs=pad, tail_split=tail_split
        )
        self.fill_inputs(rows)
        self.source.positions = step.positions
        s = self.stats
        s["total"] += 1
        s[batch.kind] += 1
        s["decode_steps"] += batch.num_decodes > 0
        for label in (f"mode {how}", f"layout {step.layout}"):
            s[label] += 1
        s[f"next_n {batch.next_n}"] += batch.num_decodes > 0
        ends = [i.start + i.q_len for i in batch.items]
        report.max_context = max(report.max_context, *ends)
        report.planned += self._planned(step)
        sides = self.sides
        if self.cfg.stages == 2:  # each step the other stage leads
            lead, other = sides[1 + index % 2], sides[2 - index % 2]
            lead.between = functools.partial(self._interleave, other, step)
            sides = sides[:1] + [lead]
        for side in sides:
            with side.active():
                self._run_side(side, step, how)
        if self.cfg.stages == 2:
            lead.between = None
            other.forwards += 1
        self._compare(step, index, report)
        self.sched.commit(batch)


def run(cfg: Config, device) -> Report:
    """Runs ``cfg`` on ``device``; the report's ``mismatches`` must be 0."""
    return Run(cfg, device).run()


__all__ = [
    "MODES",
    "REPORTS",
    "TIE_BREAK",
    "Config",
    "Report",
    "Run",
    "fuzz_seed",
    "run",
]
