# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``tools/kernel_env/sanitizer_reports.py`` and ``sanitize.sh``'s line
(CPU): a report in our kernels is counted as ours and fails; reports only in
torch's kernels are said apart, named, and do not fail; both at once; errors
the summaries count but no log prints, a run without a summary; and
``sanitize.sh`` end to end with a stand-in ``compute-sanitizer``.

The sample logs follow compute-sanitizer's formats as its users' logs show
them (a report's line, then indented lines, up to a bare ``=========``):

- memcheck and initcheck, CUDA 12.4 to 13 (``at FUNCTION+0xOFFSET [in
  FILE:LINE]``, ``by thread``, ``Address``, ``Device Frame:``): NVIDIA/cccl
  issues 1891 (``Uninitialized __global__ memory read of size 8 bytes``,
  device frames) and 1892, ikawrakow/ik_llama.cpp pull 1022 (libcudart 13);
  CUDA 11 and 12.2 (``at 0xOFFSET in [FILE:LINE:]FUNCTION``): NVIDIA/cudf
  issue 8873, NVIDIA/cccl issue 2104; ``ERROR SUMMARY: N errors`` closes
  each process;
- racecheck's analysis reports (``Error: Race reported between Write access
  at ...``, one ``and Read access at ... [N hazards]`` line a pair;
  ``Warning:`` ones are warnings) and ``RACECHECK SUMMARY: 1 hazard displayed
  (0 errors, 1 warning)``: kokkos/kokkos issue 6217, ORNL/HeCBench issues
  126 and 133, NVIDIA/cccl issue 1892;
- synccheck's ``Barrier error detected. Divergent thread(s) in warp`` (or
  ``in block``) with the same location lines: JuliaGPU/CUDAnative.jl pull
  61 (the old form, ``Device Frame:FILE:LINE:NAME (NAME : 0xOFFSET)`` and
  host frames), ggml-org/llama.cpp issue 27678 (CUDA 13.3).

Our kernels' names have the form of their CuTe DSL entry names
(``kernel_cutlass_kernel_``, the module path without its dots, the class;
the argument suffixes here are made up); torch's are its kernel templates
as compute-sanitizer demangles them."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tools.kernel_env import sanitizer_reports as sr

REPO = Path(__file__).resolve().parents[2]
TOOL = REPO / "tools/kernel_env/sanitizer_reports.py"

SELECT = (
    "kernel_cutlass_kernel_vllmmodelsglm5nextnvidiaspecialized_decodecutedsl"
    "selectkernelSelectTopk_object_at__TensorgmemoDivisibility16i32_Int32_0"
)
SCORES = (
    "kernel_cutlass_kernel_vllmmodelsglm5nextnvidiaspecialized_decodecutedsl"
    "scoreskernelKpoolScores_object_at__Tensorgmemf8E4M3FN_Int32_0"
)
EQ = (
    "void at::native::vectorized_elementwise_kernel<(int)4, "
    "at::native::(anonymous namespace)::CompareEqFunctor<int>, "
    "std::array<char *, (unsigned long)3>>(int, T2, T3)"
)
EQ_SHORT = (
    "at::native::vectorized_elementwise_kernel<(int)4, "
    "at::native::(anonymous namespace)::CompareEqFunctor<int>, std::arra..."
)
SUM = (
    "void at::native::reduce_kernel<(int)512, (int)1, at::native::ReduceOp<"
    "long, at::native::func_wrapper_t<long, at::native::sum_functor<long, long, "
    "long>::operator ()(at::TensorIterator &)::[lambda(long, long) (instance "
    "1)]>, unsigned int, long, (int)4, (int)4>>(T3)"
)
SUM_SHORT = (
    "at::native::reduce_kernel<(int)512, (int)1, at::native::ReduceOp<long, "
    "at::native::func_wrapper_t<long, at::native::s..."
)


def uninitialized(function: str, thread: int = 64) -> str:
    return f"""\
========= Uninitialized __global__ memory read of size 4 bytes
=========     at {function}+0x1f0
=========     by thread ({thread},0,0) in block (12,0,0)
=========     Address 0x7f3a1c000100
=========
"""


def log(*reports: str, summary: str | None, before: str = "") -> str:
    """A run's log: pytest's lines and the tool's, its summary last."""
    text = "========= COMPUTE-SANITIZER\n" + before + "".join(reports)
    text += "....                                                   [100%]\n"
    if summary is not None:
        text += f"========= {summary}\n"
    return text


def write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def line_of(*paths: str) -> tuple[str, bool]:
    runs = [sr.read(p) for p in paths]
    return sr.summary_line(runs), sr.failed(runs)


def test_a_report_in_ours_is_ours_and_fails(tmp_path):
    memcheck = f"""\
========= Invalid __global__ write of size 4 bytes
=========     at {SELECT}+0x1a30
=========     by thread (255,0,0) in block (3,0,0)
=========     Address 0x7f2b80002000 is out of bounds
=========     and is 4 bytes after the nearest allocation at 0x7f2b80001800 of \
size 2044 bytes
=========
"""
    path = write(tmp_path, "m.log", log(memcheck, summary="ERROR SUMMARY: 1 error"))
    line, failed = line_of(path)
    assert line == (
        "1 error reported (1 of 1 runs summarized): 1 in our kernels "
        "[1 cutedslselectkernelSelectTopk], 0 in other kernels"
    )
    assert failed


def test_reports_only_in_torch_are_said_apart_and_do_not_fail(tmp_path):
    """initcheck's reads in torch's ``eq`` of bytes no kernel wrote (the
    H100 run's 212,193, here printed in full)."""
    reports = [uninitialized(EQ, thread) for thread in (64, 65, 66)]
    path = write(tmp_path, "i.log", log(*reports, summary="ERROR SUMMARY: 3 errors"))
    line, failed = line_of(path)
    assert line == (
        "3 errors reported (1 of 1 runs summarized): 0 in our kernels, "
        f"3 in other kernels [3 {EQ_SHORT}]"
    )
    assert not failed


def test_ours_and_torch_in_two_runs(tmp_path):
    """Counted apart, each side naming its kernels; ours fails the tool."""
    select = write(
        tmp_path,
        "select.log",
        log(
            uninitialized(SELECT), uninitialized(EQ), summary="ERROR SUMMARY: 2 errors"
        ),
    )
    scores = write(
        tmp_path,
        "scores.log",
        log(*[uninitialized(SCORES)] * 2, summary="ERROR SUMMARY: 2 errors"),
    )
    line, failed = line_of(select, scores)
    assert line == (
        "4 errors reported (2 of 2 runs summarized): 3 in our kernels "
        "[2 cutedslscoreskernelKpoolScores, 1 cutedslselectkernelSelectTopk], "
        f"1 in other kernels [1 {EQ_SHORT}]"
    )
    assert failed


def test_a_clean_run(tmp_path):
    """pytest's own section bars are not the tool's lines."""
    bars = "========= 5 passed, 2 deselected in 41.20s =========\n"
    paths = [
        write(tmp_path, f"{n}.log", log(summary="ERROR SUMMARY: 0 errors", before=bars))
        for n in "ab"
    ]
    line, failed = line_of(*paths)
    assert line == (
        "0 errors reported (2 of 2 runs summarized): 0 in our kernels, "
        "0 in other kernels"
    )
    assert not failed


RACES = f"""\
========= Error: Race reported between Write access at {SUM}+0x1c90
=========     and Read access at {SUM}+0x1d40 [8 hazards]
=========     and Read access at {SUM}+0x1d80 [1 hazard]
=========
========= Warning: Race reported between Read access at {SELECT}+0x2210
=========     and Write access at {SELECT}+0x2300 [32 hazards]
=========
"""


def test_racecheck_counts_pairs_and_not_warnings(tmp_path):
    """Each ``and`` line is a displayed hazard; a warning (in ours here) is
    not an error, as racecheck's summary counts them."""
    summary = "RACECHECK SUMMARY: 3 hazards displayed (2 errors, 1 warning)"
    path = write(tmp_path, "r.log", log(RACES, summary=summary))
    line, failed = line_of(path)
    assert line == (
        "2 errors reported (1 of 1 runs summarized): 0 in our kernels, "
        f"2 in other kernels [2 {SUM_SHORT}]"
    )
    assert not failed


def test_a_race_in_ours_fails(tmp_path):
    race = f"""\
========= Error: Race reported between Write access at \
{SELECT}+0x2210 in kernel.py:412
=========     and Read access at {SELECT}+0x2290 in kernel.py:415 [4 hazards]
=========
"""
    summary = "RACECHECK SUMMARY: 1 hazard displayed (1 error, 0 warnings)"
    path = write(tmp_path, "r.log", log(race, summary=summary))
    line, failed = line_of(path)
    assert line.startswith("1 error reported (1 of 1 runs summarized): 1 in our")
    assert failed


def test_the_kernel_is_the_outermost_device_frame(tmp_path):
    """A report in a device function our kernel calls is ours, named by the
    kernel; the old location form (``at 0x... in FILE:LINE:FUNCTION``) too,
    and a report after pytest's progress dots on its line."""
    framed = f"""\
========= Invalid __shared__ read of size 16 bytes
=========     at load_vector(int)+0x90 in ptx.py:77
=========     by thread (3,0,0) in block (0,0,0)
=========     Address 0x10400 is out of bounds
=========     Device Frame:{SCORES}+0x4c10 in kernel.py:301
=========
"""
    old = """\
........========= Uninitialized __global__ memory read of size 1 bytes
=========     at 0x150 in /src/null_mask.cu:87:void \
cudf::count_set_bits_kernel<int=256>(unsigned int const *,int,int,int*)
=========     by thread (0,0,0) in block (0,0,0)
=========     Address 0x7fc406200400
=========
"""
    path = write(tmp_path, "f.log", log(framed, old, summary="ERROR SUMMARY: 2 errors"))
    line, failed = line_of(path)
    assert line == (
        "2 errors reported (1 of 1 runs summarized): 1 in our kernels "
        "[1 cutedslscoreskernelKpoolScores], 1 in other kernels "
        "[1 cudf::count_set_bits_kernel<int=256>]"
    )
    assert failed


def test_synccheck_in_either_form(tmp_path):
    """A divergent barrier in ours (CUDA 13's form) and one in another
    kernel (the old form, with host frames)."""
    ours = f"""\
========= Barrier error detected. Divergent thread(s) in block
=========     at {SELECT}+0x5b0 in kernel.py:233
=========     by thread (37,0,0) in block (5,0,0)
=========
"""
    old = """\
========= Barrier error detected. Divergent thread(s) in warp
=========     at 0x000046b8 in /src/sync.cu:12:scan_kernel
=========     by thread (2,0,0) in block (0,0,0)
=========     Device Frame:/src/sync.cu:12:scan_kernel (scan_kernel : 0x46c0)
=========     Saved host backtrace up to driver entry point at kernel launch time
=========     Host Frame:/usr/lib/libcuda.so (cuLaunchKernel + 0x2cd) [0x24c3ad]
=========
"""
    path = write(tmp_path, "s.log", log(ours, old, summary="ERROR SUMMARY: 2 errors"))
    line, failed = line_of(path)
    assert line == (
        "2 errors reported (1 of 1 runs summarized): 1 in our kernels "
        "[1 cutedslselectkernelSelectTopk], 1 in other kernels [1 scan_kernel]"
    )
    assert failed


def test_errors_past_the_print_limit_are_unknown_and_fail(tmp_path):
    """The summary counts what the log does not print: those could be
    anyone's, so the run fails, saying so."""
    reports = [uninitialized(EQ)] * 2
    summary = "ERROR SUMMARY: 212193 errors"
    path = write(tmp_path, "i.log", log(*reports, summary=summary))
    line, failed = line_of(path)
    assert line == (
        "212193 errors reported (1 of 1 runs summarized): 0 in our kernels, "
        f"2 in other kernels [2 {EQ_SHORT}]; 212191 not printed (past "
        "--print-limit), kernels unknown"
    )
    assert failed


def test_a_run_without_its_summary_fails(tmp_path):
    """A run cut at its bound (no summary), and a log that is not there."""
    cut = write(tmp_path, "cut.log", log(uninitialized(EQ), summary=None))
    line, failed = line_of(cut, str(tmp_path / "missing.log"))
    assert line == (
        "0 errors reported (0 of 2 runs summarized): 0 in our kernels, "
        f"1 in other kernels [1 {EQ_SHORT}]"
    )
    assert failed


def test_racecheck_at_its_hazard_limit_fails(tmp_path):
    limit = (
        "========= Warning: Maximum number of hazards reached. Environment "
        "variable NV_COMPUTE_SANITIZER_MAX_RACECHECK_HAZARDS can be used to "
        "increase this count.\n=========\n"
    )
    summary = "RACECHECK SUMMARY: 3 hazards displayed (2 errors, 1 warning)"
    path = write(tmp_path, "r.log", log(RACES, summary=summary, before=limit))
    line, failed = line_of(path)
    assert line.endswith("; racecheck hit its hazard limit, more went uncounted")
    assert failed


def test_the_kernels_with_the_most_are_named():
    runs = [sr.Run("x", True, 10)]
    for n, kernel in enumerate(["k1<1>(int)", "k2(int)", "k3(int)", "k4(int)"]):
        runs[0].reports += [sr.Report(f"void {kernel}", False)] * (4 - n)
    assert sr.summary_line(runs, top=2) == (
        "10 errors reported (1 of 1 runs summarized): 0 in our kernels, "
        "10 in other kernels [4 k1<1>, 3 k2, 2 more kernels]"
    )


@pytest.mark.parametrize(
    "name, short",
    [
        (SELECT, "cutedslselectkernelSelectTopk"),
        ("void f<(int)4>(int, T2) [clone .isra.0]", "f<(int)4>"),
        ("compress(const unsigned int *, uint2 *, int)", "compress"),
        ("(anonymous)", "(anonymous)"),
    ],
)
def test_short_names(name, short):
    assert sr.short(name) == short


def test_the_command_line(tmp_path):
    """One line on stdout; exit 1 for ours, 0 for others only."""
    ours = write(
        tmp_path, "o.log", log(uninitialized(SELECT), summary="ERROR SUMMARY: 1 error")
    )
    theirs = write(
        tmp_path, "t.log", log(uninitialized(EQ), summary="ERROR SUMMARY: 1 error")
    )
    for paths, code in (([theirs], 0), ([theirs, ours], 1)):
        run = subprocess.run(
            [sys.executable, str(TOOL), *paths], capture_output=True, text=True
        )
        assert run.returncode == code, run.stderr
        assert run.stdout.count("\n") == 1 and " reported (" in run.stdout


# --- sanitize.sh with a stand-in compute-sanitizer ------------------------------

# Prints the canned log of the module it is given, writes a JUnit XML of one
# passed test where pytest would, and exits as the tool would (99: errors).
STAND_IN = """\
#!/usr/bin/env python3
import os, re, sys
from pathlib import Path

args = sys.argv[1:]
logs = Path(os.environ["FAKE_LOGS"])
(logs / "args.txt").open("a").write(" ".join(args) + "\\n")
module = Path(next(a for a in args if a.endswith(".py"))).stem
xml = next(a.split("=", 1)[1] for a in args if a.startswith("--junitxml="))
Path(xml).write_text('<testsuites><testsuite><testcase classname="m" name="t"/>'
                     "</testsuite></testsuites>")
text = (logs / (module + ".log")).read_text()
print(text, end="")
sys.exit(99 if re.search(r"SUMMARY: [1-9]|\\([1-9]\\d* errors?", text) else 0)
"""


@pytest.fixture
def fake_gpu(tmp_path):
    """A copy of the tools beside a stand-in ``.device`` and a stand-in
    ``compute-sanitizer`` first on PATH. (``sanitize.sh`` copies the stage
    to /tmp/kpool-stock: skipped where a real one is there.)"""
    if os.path.exists("/tmp/kpool-stock"):
        pytest.skip("/tmp/kpool-stock exists: a GPU tier run's stage")
    root = tmp_path / "tree"
    tools = root / "tools/kernel_env"
    tools.mkdir(parents=True)
    for name in ("sanitize.sh", "gpu_tier.sh", "sanitizer_reports.py"):
        shutil.copy2(REPO / "tools/kernel_env" / name, tools / name)
    (root / ".device/stock").mkdir(parents=True)
    (root / ".device/env.sh").write_text("true\n")
    bin_dir, logs = tmp_path / "bin", tmp_path / "logs"
    bin_dir.mkdir()
    logs.mkdir()
    stand_in = bin_dir / "compute-sanitizer"
    stand_in.write_text(STAND_IN)
    stand_in.chmod(0o755)
    path = os.pathsep.join([str(bin_dir), str(Path(sys.executable).parent)])
    env = os.environ | {
        "PATH": path + os.pathsep + os.environ["PATH"],
        "FAKE_LOGS": str(logs),
        "OUT": str(tmp_path / "out"),
        "KPOOL_SANITIZE_MODULES": "t/test_select.py t/test_scores.py",
    }
    yield root, logs, env
    shutil.rmtree("/tmp/kpool-stock", ignore_errors=True)


def sanitize(root: Path, env: dict, *tools: str) -> subprocess.CompletedProcess:
    script = root / "tools/kernel_env/sanitize.sh"
    return subprocess.run(
        [str(script), *tools], env=env, capture_output=True, text=True, timeout=120
    )


def test_sanitize_sh_says_torch_apart_and_passes(fake_gpu):
    root, logs, env = fake_gpu
    (logs / "test_select.log").write_text(log(summary="ERROR SUMMARY: 0 errors"))
    reports = log(uninitialized(EQ), summary="ERROR SUMMARY: 1 error")
    (logs / "test_scores.log").write_text(reports)
    run = sanitize(root, env, "initcheck")
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.splitlines()[0] == (
        "initcheck: 1 error reported (2 of 2 runs summarized): 0 in our "
        f"kernels, 1 in other kernels [1 {EQ_SHORT}] | pytest: 2 passed, "
        "0 failed, 0 errors, 0 SKIPPED | exit: 0 99"
    )
    args = (logs / "args.txt").read_text()
    assert "--show-backtrace device" in args and "--print-limit 10000" in args


def test_sanitize_sh_fails_on_a_report_in_ours(fake_gpu):
    root, logs, env = fake_gpu
    reports = log(uninitialized(SELECT), summary="ERROR SUMMARY: 1 error")
    (logs / "test_select.log").write_text(reports)
    (logs / "test_scores.log").write_text(log(summary="ERROR SUMMARY: 0 errors"))
    run = sanitize(root, env, "memcheck")
    assert run.returncode == 1, run.stdout + run.stderr
    assert run.stdout.startswith(
        "memcheck: 1 error reported (2 of 2 runs summarized): 1 in our kernels "
        "[1 cutedslselectkernelSelectTopk], 0 in other kernels | pytest: 2 passed"
    )
