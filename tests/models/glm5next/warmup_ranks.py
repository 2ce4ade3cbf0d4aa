# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""One rank of ``test_warmup.py``'s multi-process warmups: vLLM's
distributed state on the CPU (gloo, ``world`` ranks in TP groups of ``tp``,
pipeline stages of the rest), then one ``StageWarmup.compiled`` per
scenario in order (``SCENARIOS``, or ``GROUP_SCENARIOS`` where the world
holds more than one TP group), each on a stage of its own. A scenario
gives each rank's verdict at the self-check's seam (``self_check.check``,
which needs a GPU) or makes a rank's compile raise. Prints one JSON line:
the rank's TP group, and per scenario whether the stage got its
executors, its warmup log lines, what it raised and the seed its
self-check was given.

Run as ``python warmup_ranks.py RANK WORLD PORT [TP]`` (TP: the world
unless given; the patched vLLM on ``PYTHONPATH``, as the tests' conftest.py
exports it). ``cpu_ranks`` is also the conftest's ``one_cpu_rank``."""

import contextlib
import json
import logging
import sys
from types import SimpleNamespace

import torch

# (self-check mode, ranks whose self-check fails, ranks whose compile raises)
SCENARIOS = (
    ("on", (), ()),
    ("on", (1,), ()),
    ("on", (), (0,)),
    ("strict", (2,), ()),
    ("off", (1,), ()),
    ("strict", (), (1,)),
)
# TP 2 x PP 2 (TP groups: ranks 0, 1 and 2, 3): a failure in one TP group.
GROUP_SCENARIOS = (
    ("on", (1,), ()),
    ("on", (2,), ()),
)


class Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append([record.levelname, record.getMessage()])


def run(rank: int, mode: str, fails, raises) -> dict:
    from vllm.models.glm5next.nvidia.specialized_decode import self_check
    from vllm.models.glm5next.nvidia.specialized_decode.runtime import warmup

    seeds = []

    def check(executors, seed, device):
        seeds.append(seed)
        if rank in fails:
            return f"UpcastKernel case 3 (seed {seed + 3}) differs from stock: key"
        return None

    class Kernel:
        def executor(self, key):
            if rank in raises:
                raise RuntimeError("no ptxas")
            return f"executor of {key}"

    self_check.check = check
    kernel = Kernel()
    stage = SimpleNamespace(executors={}, pool_buffer=torch.zeros(1), kernels=[kernel])
    entry = warmup.StageWarmup(stage, [], mode)
    lines = Lines()
    logger = logging.getLogger(warmup.__name__)
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)  # whatever VLLM_LOGGING_LEVEL says
    raised = None
    try:
        entry.compiled(kernel, ["key"])
    except Exception as error:
        raised = f"{type(error).__name__}: {error}"
    logger.removeHandler(lines)
    on = bool(stage.executors)
    return dict(on=on, lines=lines.lines, raised=raised, seeds=seeds)


@contextlib.contextmanager
def cpu_ranks(world: int, rank: int, init_method: str, tp: int | None = None):
    """vLLM's distributed environment and model parallel groups over
    ``world`` CPU processes (gloo), TP groups of ``tp`` (None: one of all)
    and the pipeline parallel size the rest; torn down after."""
    tp = world if tp is None else tp
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state

    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig("cpu"))):
        parallel_state.init_distributed_environment(
            world, rank, init_method, local_rank=rank, backend="gloo"
        )
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=world // tp
        )
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        parallel_state.destroy_distributed_environment()


def main(rank: int, world: int, port: int, tp: int | None = None) -> None:
    from vllm.distributed import get_tp_group

    scenarios = SCENARIOS if tp in (None, world) else GROUP_SCENARIOS
    with cpu_ranks(world, rank, f"tcp://127.0.0.1:{port}", tp):
        group = get_tp_group().ranks
        results = [run(rank, *scenario) for scenario in scenarios]
        print(json.dumps(dict(rank=rank, group=group, results=results)), flush=True)


if __name__ == "__main__":
    main(*map(int, sys.argv[1:]))
