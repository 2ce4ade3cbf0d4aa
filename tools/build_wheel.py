#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Build the fork wheel: the pinned stock vLLM wheel with the patch set.

    python tools/build_wheel.py [--wheel STOCK.whl] [--dist-dir dist]

Steps, each timed: fetch the stock wheel (``--wheel``, else the cache dir,
else ``pip download --no-deps vllm==<base>`` into it), verify its sha256
against ``patches/base.json``, ``python -m wheel unpack``, apply the patch
set (``tools/patchset.py``), set the version to the PEP 440 local version
``<base>+glm5next.kpool<N>`` (N = number of patches in the series; the
dist-info dir is renamed and METADATA's ``Version:`` rewritten), and pack it
again with ``wheel``'s ``WheelFile`` (what ``python -m wheel pack`` runs),
which rewrites RECORD with fresh hashes. ``<base>`` is ``vllm_version`` in
``patches/base.json``. The result is ``dist/vllm-<version>-<tags>.whl``. Zip
timestamps come from ``SOURCE_DATE_EPOCH`` (default: the stock wheel's newest
entry), so the build is reproducible. Long steps print a progress line every
10 s. Needs ``pip`` and ``wheel`` in this interpreter, and ``git``.
"""

from __future__ import annotations

import argparse
import calendar
import contextlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tools import patchset  # noqa: E402
from tools.patchset import Patchset, PatchsetError  # noqa: E402

REPO_ROOT = patchset.REPO_ROOT
LOCAL_LABEL = "glm5next.kpool"
_LOCAL_VERSION = re.compile(r"^\d+(\.\d+)*\+[a-z0-9]+(\.[a-z0-9]+)*$")

Log = Callable[[str], None]


def _say(msg: str) -> None:
    print(msg, flush=True)


def fork_version(ps: Patchset) -> str:
    """``<base>+glm5next.kpool<N>``, N = the number of patches in the series."""
    version = f"{ps.base['vllm_version']}+{LOCAL_LABEL}{len(ps.patches)}"
    if not _LOCAL_VERSION.match(version):
        raise PatchsetError(f"{version!r} is not a PEP 440 local version")
    return version


HEARTBEAT_S = 10.0


@contextlib.contextmanager
def _heartbeat(
    label: str, log: Log, probe: Callable[[], str] | None = None
) -> Iterator[None]:
    """While the body runs, log ``label``, the time so far and ``probe()``
    every ``HEARTBEAT_S`` seconds."""
    start = time.monotonic()
    done = threading.Event()

    def beat() -> None:
        while not done.wait(HEARTBEAT_S):
            extra = f", {probe()}" if probe else ""
            log(f"    ... {label}: {time.monotonic() - start:.0f} s{extra}")

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def _run(cmd: list[str], label: str, log: Log) -> None:
    """Run ``cmd`` with inherited stdout/stderr, with a heartbeat."""
    with _heartbeat(label, log):
        rc = subprocess.Popen(cmd).wait()
    if rc != 0:
        raise PatchsetError(f"{label} failed (exit {rc}): {' '.join(cmd)}")


def fetch(ps: Patchset, cache_dir: Path, log: Log = _say) -> Path:
    """The stock wheel in ``cache_dir``, downloaded with pip if missing."""
    wheel = cache_dir / str(ps.base["wheel"])
    if wheel.is_file():
        log(f"    cached: {wheel}")
        return wheel
    cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".download-", dir=cache_dir) as tmp:
        req = f"vllm=={ps.base['vllm_version']}"
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps"]
        cmd += ["--only-binary=:all:", "--dest", tmp, req]
        log(f"    pip download {req} (~340 MB) into {cache_dir}")
        _run(cmd, "pip download", log)
        got = Path(tmp, wheel.name)
        if not got.is_file():
            found = ", ".join(sorted(os.listdir(tmp))) or "nothing"
            raise PatchsetError(
                f"pip download {req} gave {found}, not {wheel.name} "
                "(patches/base.json); pass the base wheel with --wheel"
            )
        os.replace(got, wheel)
    return wheel


def verify(ps: Patchset, wheel: Path) -> None:
    """Refuse any wheel but the pinned one: another vLLM version (both named),
    else another build or a damaged download of the base (sha256)."""
    patchset.check_wheel_version(ps, wheel)
    found = patchset.sha256_file(wheel)
    expected = ps.base["wheel_sha256"]
    if found != expected:
        raise PatchsetError(
            f"{wheel}: expected base wheel sha256 {expected} ({ps.base_json}), "
            f"found {found}: it is vLLM {ps.version}, but another build of it or "
            f"a damaged download. Use {ps.base['wheel']}: delete this one and run "
            "`make fetch`, or pass the pinned wheel with --wheel."
        )


def wheel_tags(wheel_name: str) -> list[str]:
    """The tags a wheel file name declares (``py-abi-plat``, dot sets expanded)."""
    parts = wheel_name.removesuffix(".whl").split("-")
    if len(parts) not in (5, 6):
        raise PatchsetError(f"{wheel_name}: not a wheel file name")
    pys, abis, plats = (p.split(".") for p in parts[-3:])
    return [f"{py}-{abi}-{plat}" for py in pys for abi in abis for plat in plats]


def _rewrite_headers(path: Path, headers: dict[bytes, list[bytes]]) -> None:
    """Replace the named RFC 822 headers of ``path``, keeping all else."""
    head, sep, body = path.read_bytes().partition(b"\n\n")
    lines = head.split(b"\n")
    for key, values in headers.items():
        idx = [i for i, line in enumerate(lines) if line.startswith(key + b":")]
        if not idx:
            raise PatchsetError(f"{path}: no {key.decode()}: header")
        new = [key + b": " + v for v in values]
        lines[idx[0] : idx[-1] + 1] = new
        if len(idx) != idx[-1] - idx[0] + 1:
            raise PatchsetError(f"{path}: {key.decode()}: headers are not contiguous")
    path.write_bytes(b"\n".join(lines) + sep + body)


def set_version(unpacked: Path, version: str, tags: list[str]) -> Path:
    """Rename the single ``vllm-*.dist-info``, rewrite METADATA's Version and
    WHEEL's Tag lines (stock WHEEL says linux_x86_64 while its file name says
    manylinux_2_28_x86_64; the fork wheel keeps the file name's tags)."""
    dist_infos = sorted(unpacked.glob("vllm-*.dist-info"))
    if len(dist_infos) != 1:
        raise PatchsetError(
            f"{unpacked}: expected one vllm-*.dist-info, got {dist_infos}"
        )
    new = unpacked / f"vllm-{version}.dist-info"
    dist_infos[0].rename(new)
    _rewrite_headers(new / "METADATA", {b"Version": [version.encode()]})
    _rewrite_headers(new / "WHEEL", {b"Tag": [t.encode() for t in tags]})
    return new


def _newest_entry_epoch(wheel: Path) -> int:
    with zipfile.ZipFile(wheel) as zf:
        return max(calendar.timegm((*i.date_time, 0, 0, -1)) for i in zf.infolist())


@contextlib.contextmanager
def _source_date_epoch(default: int) -> Iterator[None]:
    """``SOURCE_DATE_EPOCH`` (read by WheelFile for every member's time),
    ``default`` unless the caller set it."""
    old = os.environ.get("SOURCE_DATE_EPOCH")
    os.environ["SOURCE_DATE_EPOCH"] = old or str(default)
    try:
        yield
    finally:
        if old is None:
            del os.environ["SOURCE_DATE_EPOCH"]


def pack(unpacked: Path, out: Path, epoch: int, log: Log = _say) -> Path:
    """Zip ``unpacked`` into the wheel ``out`` as ``python -m wheel pack``
    does (``WheelFile.write_files``, RECORD rewritten), in-process so that
    the heartbeat names the member being compressed: the largest, a ~300 MB
    .so, writes nothing for ~10 s. ``out`` appears only once complete."""
    from wheel.wheelfile import WheelFile

    sizes = {p: p.stat().st_size for p in unpacked.rglob("*") if p.is_file()}
    total_mb, done = sum(sizes.values()) / 2**20, {"bytes": 0, "files": 0}
    current = ["nothing yet"]

    class ProgressWheelFile(WheelFile):
        def write(self, filename, arcname=None, compress_type=None):
            size = sizes.get(Path(filename), 0)
            current[0] = f"{arcname} ({size / 2**20:.1f} MB)"
            super().write(filename, arcname, compress_type)
            done["bytes"] += size
            done["files"] += 1

    def probe() -> str:
        return (
            f"{done['bytes'] / 2**20:.0f} of {total_mb:.0f} MB packed "
            f"({done['files']} of {len(sizes)} files), compressing {current[0]}"
        )

    with tempfile.TemporaryDirectory(prefix=".pack-", dir=out.parent) as tmp:
        part = Path(tmp, out.name)  # WheelFile needs a wheel's file name
        with (
            _source_date_epoch(epoch),
            _heartbeat("wheel pack", log, probe),
            ProgressWheelFile(part, "w") as wf,
        ):
            wf.write_files(str(unpacked))
        os.replace(part, out)
    return out


def build(
    wheel: str | os.PathLike[str] | None = None,
    *,
    cache_dir: str | os.PathLike[str] = patchset.DEFAULT_CACHE_DIR,
    build_dir: str | os.PathLike[str] = REPO_ROOT / "build" / "wheel",
    dist_dir: str | os.PathLike[str] = REPO_ROOT / "dist",
    root: str | os.PathLike[str] = REPO_ROOT,
    keep_unpacked: bool = False,
    log: Log = _say,
) -> Path:
    """Build the fork wheel; returns its path in ``dist_dir``. The unpacked
    tree stays in ``build_dir/vllm-<base>`` with ``keep_unpacked``."""
    if importlib.util.find_spec("wheel") is None:
        raise PatchsetError(
            f"{sys.executable}: needs the `wheel` package (pip install wheel)"
        )
    ps = Patchset.load(root)
    version = fork_version(ps)
    build_dir, dist_dir = Path(build_dir).absolute(), Path(dist_dir).absolute()
    unpacked = build_dir / f"vllm-{ps.base['vllm_version']}"
    total = time.monotonic()

    def step(n: int, what: str, fn: Callable[[], object]) -> object:
        log(f"[{n}/6] {what}")
        start = time.monotonic()
        out = fn()
        log(f"[{n}/6] {what}: done in {time.monotonic() - start:.1f} s")
        return out

    if wheel is None:
        stock = step(1, "fetch stock wheel", lambda: fetch(ps, Path(cache_dir), log))
    else:
        stock = step(1, "fetch stock wheel", lambda: Path(wheel).absolute())
    step(2, f"verify sha256 of {stock.name}", lambda: verify(ps, stock))

    def unpack() -> None:
        shutil.rmtree(unpacked, ignore_errors=True)
        build_dir.mkdir(parents=True, exist_ok=True)
        cmd = [
            sys.executable,
            "-m",
            "wheel",
            "unpack",
            "-d",
            str(build_dir),
            str(stock),
        ]
        _run(cmd, "wheel unpack", log)

    step(3, f"unpack into {build_dir}", unpack)
    step(4, "apply the patch set", lambda: patchset.apply(unpacked, ps, log=log))
    tags = wheel_tags(stock.name)
    step(5, f"set version {version}", lambda: set_version(unpacked, version, tags))

    def repack() -> Path:
        dist_dir.mkdir(parents=True, exist_ok=True)
        for old in dist_dir.glob(f"vllm-{version}-*.whl"):
            old.unlink()
        name = f"vllm-{version}-{'-'.join(stock.name[:-4].split('-')[-3:])}.whl"
        return pack(unpacked, dist_dir / name, _newest_entry_epoch(stock), log)

    out = step(6, f"repack into {dist_dir} (rewrites RECORD; takes a while)", repack)
    if not keep_unpacked:
        shutil.rmtree(unpacked, ignore_errors=True)
    log(
        f"built {out} ({out.stat().st_size / 2**20:.1f} MiB) "
        f"in {time.monotonic() - total:.1f} s"
    )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="tools/build_wheel.py", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--wheel", help="the stock wheel (default: download into the cache)"
    )
    parser.add_argument(
        "--cache-dir", default=patchset.DEFAULT_CACHE_DIR, help="default: %(default)s"
    )
    parser.add_argument(
        "--build-dir",
        default=REPO_ROOT / "build" / "wheel",
        help="default: %(default)s",
    )
    parser.add_argument(
        "-d", "--dist-dir", default=REPO_ROOT / "dist", help="default: %(default)s"
    )
    parser.add_argument(
        "--keep-unpacked", action="store_true", help="keep the unpacked tree"
    )
    parser.add_argument(
        "--fetch-only",
        action="store_true",
        help="only fetch and verify the stock wheel",
    )
    args = parser.parse_args(argv)
    try:
        if args.fetch_only:
            ps = Patchset.load()
            stock = Path(args.wheel) if args.wheel else fetch(ps, Path(args.cache_dir))
            verify(ps, stock)
            _say(f"stock wheel ok: {stock}")
            return 0
        build(
            args.wheel,
            cache_dir=args.cache_dir,
            build_dir=args.build_dir,
            dist_dir=args.dist_dir,
            keep_unpacked=args.keep_unpacked,
        )
    except PatchsetError as e:
        print(f"build_wheel: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
