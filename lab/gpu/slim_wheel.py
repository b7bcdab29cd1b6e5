"""Copy a wheel without some of its files, for the GPU stacks (lab/gpu/stage_gpu_03x.sh).

    python3 lab/gpu/slim_wheel.py IN.whl OUT.whl PATH...

Each PATH (a file or a directory inside the wheel) must be there: a name that is not stops
the staging, so a renamed kernel tree is noticed. Their RECORD rows go too, so pip installs
the slimmed wheel as usual. A run carries 64 MiB, so every MiB dropped is device time saved.
"""

from __future__ import annotations

import csv
import io
import os
import sys
import zipfile


def slim(src: str, dst: str, drop: list[str]) -> int:
    """Write ``dst``: ``src`` less ``drop``; the bytes dropped (unpacked)."""
    zin = zipfile.ZipFile(src)
    names = zin.namelist()

    def dropped(name: str) -> bool:
        return any(name == d or name.startswith(d.rstrip("/") + "/") for d in drop)

    for d in drop:
        if not any(n == d or n.startswith(d.rstrip("/") + "/") for n in names):
            sys.exit(f"slim: {d} is not in {src}")
    record = next(n for n in names if n.endswith(".dist-info/RECORD"))
    gone = sum(i.file_size for i in zin.infolist() if dropped(i.filename))
    with zipfile.ZipFile(dst + ".tmp", "w", zipfile.ZIP_DEFLATED, compresslevel=6) as zout:
        for info in zin.infolist():
            name = info.filename
            if dropped(name):
                continue
            if name == record:
                text = zin.read(name).decode()
                rows = [r for r in csv.reader(io.StringIO(text)) if r and not dropped(r[0])]
                buf = io.StringIO()
                csv.writer(buf, lineterminator="\n").writerows(rows)
                zout.writestr(info, buf.getvalue(), compress_type=zipfile.ZIP_DEFLATED)
            else:
                with zin.open(info) as f:
                    zout.writestr(
                        info, f.read(), compress_type=zipfile.ZIP_DEFLATED, compresslevel=6
                    )
    os.replace(dst + ".tmp", dst)
    return gone


def main() -> None:
    src, dst, drop = sys.argv[1], sys.argv[2], sys.argv[3:]
    gone = slim(src, dst, drop)
    print(f"  {os.path.basename(dst)}: dropped {gone / 2**20:.0f} MiB unpacked ({', '.join(drop)})")


if __name__ == "__main__":
    main()
