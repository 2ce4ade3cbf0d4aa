#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Build the fork wheel: the pinned stock vLLM wheel with the patch set.

    tools/build_wheel.py [--wheel STOCK.whl] [-d DIST_DIR] [--fetch-only]

The stock wheel is repacked, not rebuilt, so its compiled kernels stay the
pinned ones byte for byte. The result, dist/vllm-<base>+glm5next.kpool<N>-...whl
(N: the patches in the series), has its dist-info renamed, METADATA's Version
set and RECORD rewritten; members keep the stock order and timestamps, so two
builds are identical.
"""

from __future__ import annotations

import argparse
import base64
import csv
import hashlib
import io
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tools import patchset  # noqa: E402
from tools.patchset import Patchset, PatchsetError  # noqa: E402

EPOCH = (1980, 1, 1, 0, 0, 0)  # zip's, for the members the stock wheel lacks


def fork_version(ps: Patchset) -> str:
    return f"{ps.version}+glm5next.kpool{len(ps.patches)}"


def fetch(ps: Patchset, cache_dir: Path = patchset.CACHE_DIR, log=print) -> Path:
    """The pinned stock wheel in ``cache_dir``, downloaded by pip if missing."""
    if not (wheel := cache_dir / ps.base["wheel"]).is_file():
        cache_dir.mkdir(parents=True, exist_ok=True)
        log(f"pip download vllm=={ps.version} (~340 MB) into {cache_dir}")
        with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
            pip = [sys.executable, "-m", "pip", "download", "--no-deps", "-d", tmp]
            subprocess.run(
                [*pip, "--only-binary=:all:", f"vllm=={ps.version}"], check=True
            )
            for got in Path(tmp).glob("*.whl"):
                os.replace(got, cache_dir / got.name)
    return patchset.check_wheel(ps, wheel)


def build(wheel=None, *, dist_dir=patchset.REPO_ROOT / "dist", root=None, log=print):
    """Repack the stock wheel (default: fetched into the cache) as the fork's;
    returns the path of the fork wheel."""
    ps = Patchset.load(root or patchset.REPO_ROOT)
    stock = patchset.check_wheel(ps, Path(wheel)) if wheel else fetch(ps, log=log)
    files = patchset.patched_files(ps, patchset.stock_files(ps, wheel=stock))
    files.update({rel: (ps.root / rel).read_bytes() for rel in ps.added})
    version = fork_version(ps)
    old_info, new_info = f"vllm-{ps.version}.dist-info/", f"vllm-{version}.dist-info/"
    out = Path(dist_dir) / stock.name.replace(f"-{ps.version}-", f"-{version}-")
    out.parent.mkdir(parents=True, exist_ok=True)
    part, record = out.with_name(out.name + ".part"), []
    log(f"repacking {stock.name} with {len(ps.patches)} patch(es) into {out}")
    try:
        with zipfile.ZipFile(stock) as src, zipfile.ZipFile(part, "w") as dst:
            members = [i for i in src.infolist() if i.filename != old_info + "RECORD"]
            added = sorted(set(files) - set(src.namelist()))
            members += [zipfile.ZipInfo(rel, EPOCH) for rel in added]
            for info in sorted(members, key=lambda i: i.filename.startswith(old_info)):
                rel = info.filename
                data = files[rel] if rel in files else src.read(info)
                name = rel.replace(old_info, new_info)
                if name == new_info + "METADATA":
                    new = b"Version: " + version.encode()
                    data = re.sub(rb"(?m)^Version: .*$", new, data, count=1)
                record.append(_add(dst, name, info.date_time, info.external_attr, data))
            record.append([f"{new_info}RECORD", "", ""])
            csv.writer(text := io.StringIO(), lineterminator="\n").writerows(record)
            _add(dst, new_info + "RECORD", EPOCH, 0, text.getvalue().encode())
        os.replace(part, out)
    finally:
        part.unlink(missing_ok=True)
    log(f"built {out}")
    return out


def _add(dst: zipfile.ZipFile, name: str, date_time, mode: int, data: bytes) -> list:
    """Add a member (mode 0: a plain file); its RECORD row."""
    info = zipfile.ZipInfo(name, date_time)
    info.external_attr = mode or 0o100644 << 16
    dst.writestr(info, data, zipfile.ZIP_DEFLATED)
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
    return [name, f"sha256={digest.decode()}", len(data)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--wheel", help="the stock wheel (default: fetch it)")
    parser.add_argument("-d", "--dist-dir", default=patchset.REPO_ROOT / "dist")
    parser.add_argument("--fetch-only", action="store_true", help="fetch, verify")
    args = parser.parse_args(argv)
    try:
        if args.fetch_only:
            ps = Patchset.load()
            wheel = (
                patchset.check_wheel(ps, Path(args.wheel)) if args.wheel else fetch(ps)
            )
            print(f"stock wheel ok: {wheel}")
        else:
            build(args.wheel, dist_dir=args.dist_dir)
        sys.stdout.flush()
    except (PatchsetError, subprocess.CalledProcessError) as e:
        print(f"build_wheel: error: {e}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        return patchset.quiet_broken_pipe()
    return 0


if __name__ == "__main__":
    sys.exit(main())
