# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""One tensor-parallel rank of ``test_warmup.py``'s multi-process warmups:
vLLM's distributed state on the CPU (gloo, ``world`` ranks, one TP group),
then one ``StageWarmup.compiled`` per scenario of ``SCENARIOS`` in
order, each on a stage of its own. A scenario gives each rank's verdict at
the self-check's seam (``self_check.check``, which needs a GPU) or makes a
rank's compile raise. Prints one JSON line: per scenario, whether the stage
got its executors, its warmup log lines and what it raised.

Run as ``python warmup_ranks.py RANK WORLD PORT`` (the patched vLLM on
``PYTHONPATH``, as the tests' conftest.py exports it). ``cpu_ranks`` is
also the conftest's ``one_cpu_rank``."""

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


class Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append([record.levelname, record.getMessage()])


def run(rank: int, mode: str, fails, raises) -> dict:
    from vllm.models.glm5next.nvidia.specialized_decode import self_check
    from vllm.models.glm5next.nvidia.specialized_decode.runtime import warmup

    def check(executors, seed, device):
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
    return dict(on=bool(stage.executors), lines=lines.lines, raised=raised)


@contextlib.contextmanager
def cpu_ranks(world: int, rank: int, init_method: str):
    """vLLM's distributed environment and model parallel groups over
    ``world`` CPU processes (gloo), one TP group of all; torn down after."""
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state

    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig("cpu"))):
        parallel_state.init_distributed_environment(
            world, rank, init_method, local_rank=rank, backend="gloo"
        )
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        parallel_state.destroy_distributed_environment()


def main(rank: int, world: int, port: int) -> None:
    with cpu_ranks(world, rank, f"tcp://127.0.0.1:{port}"):
        results = [run(rank, *scenario) for scenario in SCENARIOS]
        print(json.dumps(dict(rank=rank, results=results)), flush=True)


if __name__ == "__main__":
    main(*map(int, sys.argv[1:4]))
