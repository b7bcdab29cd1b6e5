"""Tables of ``gpu_pd_e2e`` runs: generated tokens vs the colocated baseline, the
negative control, decode timings and what the decode worker registered, from each cell's
``cell.json`` and ``baseline.json`` (no GPU needed: the report of a run is rebuilt here).

    python -m lab.gpu_checks.gpu_pd_e2e_report OUT [OUT ...]
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path


def _load(dirs: list[Path]) -> tuple[dict, list[dict]]:
    """Baselines and cells of several runs; a later run's cell replaces an earlier one."""
    baselines, cells = {}, {}
    for d in dirs:
        for path in sorted(d.glob("baseline__*/baseline.json")):
            b = json.loads(path.read_text())
            if b.get("main") or (b["model"], b["runner"]) not in baselines:
                baselines[(b["model"], b["runner"])] = b
        for path in sorted(d.glob("*/cell.json")):
            cell = json.loads(path.read_text())
            cells[cell["cell"]] = cell
    return baselines, list(cells.values())


def cell_succeeded(cell: dict) -> bool:
    """Both engines exited cleanly (results read from a cell whose engine failed are not its)."""
    return cell.get("rc_prefill") == 0 and cell.get("rc_decode") == 0


def compare(cell: dict, base: dict | None, batches: list[str]) -> str:
    """'same/total' prompts whose decode tokens equal the colocated engine's, over batches.

    Tokens, not logprobs: with dummy weights the logits are nearly tied (every greedy logprob
    is -ln 4096), so logprobs agree whatever the KV, while the argmax among near-ties flips
    at the smallest difference in the KV read (the negative control shows it)."""
    decode = cell.get("decode") or {}
    batches = [b for b in batches if b in decode and base is not None and b in base]
    if not batches:
        return "n/a"
    pairs = [
        (a, b)
        for batch in batches
        for a, b in zip(decode[batch]["tokens"], base[batch]["tokens"], strict=True)
    ]
    return f"{sum(a == b for a, b in pairs)}/{len(pairs)}"


def registration(lines: list[str]) -> str:
    """'6 owners / 4 sharers skipped (1 region, 1.26 s)' from our worker's log line (the
    line before the backends split gave the seconds inside the brackets, now after them)."""
    pattern = re.compile(
        r"registered (\d+) owner layer\(s\) in (\d+) region\(s\) \([\d.]+ MiB(?:, ([\d.]+) s)?\)"
        r"(?:.*? in ([\d.]+) s from)?.*?(\d+) sharing layer\(s\) not"
    )
    for line in lines:
        if m := pattern.search(line):
            owners, regions, before, after, sharers = m.groups()
            seconds = before or after
            return f"{owners} owners / {sharers} sharers skipped ({regions} region, {seconds} s)"
        if m := re.search(r"(\d+) owner layer\(s\) handed to LMCache, (\d+) sharing", line):
            return f"{m[1]} owners handed to LMCache / {m[2]} sharers not"
    return "-"


def lmcache_hits(lines: list[str]) -> str:
    """'LMCache hit 768 of 940 prompt tokens', summed over LMCache's own connector's log."""
    pattern = re.compile(r"Total tokens (\d+),.*LMCache hit tokens: (\d+|None)")
    total = hit = 0
    for line in lines:
        if m := pattern.search(line):
            total += int(m.group(1))
            hit += int(m.group(2)) if m.group(2) != "None" else 0
    return f"LMCache hit {hit:,} of {total:,} prompt tokens" if total else "no LMCache hit logged"


def report(dirs: list[Path]) -> str:
    baselines, cells = _load(dirs)
    lines = [
        "| cell | tokens = baseline: first batch | all batches "
        "| negative control: tokens = baseline "
        "| decode first batch s | decode steady batch s (median [min-max]) "
        "| decode registration (owners / sharers) |",
        "|---|---|---|---|---|---|---|",
    ]
    for cell in sorted(cells, key=lambda c: c["cell"]):
        if not cell_succeeded(cell):  # what it holds may be an earlier run's
            cell = {**cell, "decode": None}
        base = baselines.get((cell["model"], cell.get("runner", "v1")))
        decode = cell.get("decode") or {}
        tokens = compare(cell, base, ["main"])
        every = compare(cell, base, ["main", *(k for k in decode if k.startswith("steady"))])
        control = compare(cell, base, ["corrupt"])
        first = decode.get("main", {}).get("seconds")
        steady = [decode[k]["seconds"] for k in decode if k.startswith("steady")]
        steady_s = (
            f"{statistics.median(steady):.3f} [{min(steady):.3f}-{max(steady):.3f}]"
            if steady
            else "n/a"
        )
        reg = registration(cell.get("decode_registration", []))
        if cell.get("connector") == "LMCacheConnectorV1":
            reg = lmcache_hits(cell.get("decode_lmcache_hits", []))
        if not decode:
            tokens = f"FAILED (rc {cell.get('rc_prefill')}/{cell.get('rc_decode')})"
        lines.append(
            f"| {cell['cell']} | {tokens} | {every} | {control} | "
            f"{'n/a' if first is None else f'{first:.3f}'} | {steady_s} | {reg} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    print(report([Path(d) for d in sys.argv[1:]]))
