#!/usr/bin/env python3
"""Combine rounds of `steptime_table.sh` into one table: each cell predicted / measured median
step / predicted - measured, then each layout's error range, and per round how many layouts are
within 25% (of the median step; and, for tables that have it, of the mean step T/N).

    python3 tests/planner/steptime_rounds.py round1.md round2.md round3.md
"""
import re
import sys


def micros(cell):
    """`1,234 µs` as 1234.0."""
    return float(cell.replace("µs", "").replace(",", "").strip())


def error(predicted, measured):
    """(predicted - measured) / measured in percent, from the cells (not their rounded percent)."""
    return (micros(predicted) - micros(measured)) / micros(measured) * 100


def rows(path):
    out = {}
    for line in open(path, encoding="utf-8"):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) not in (4, 6) or not cells[3].endswith("%") or cells[0] == "layout":
            continue
        measured = cells[2].split(" (")[0]
        mean = cells[4].split(" (")[0] if len(cells) == 6 else None
        out[cells[0]] = (cells[1], measured, error(cells[1], measured), error(cells[1], mean) if mean else None)
    return out


def main(paths):
    rounds = [rows(p) for p in paths]
    names = list(rounds[0])
    head = " | ".join(f"round {i + 1}" for i in range(len(rounds)))
    print(f"| layout | {head} | error range |")
    print("|---|" + "---|" * len(rounds) + "---|")
    for name in names:
        cells, errors = [], []
        for r in rounds:
            if name in r:
                p, m, e, _ = r[name]
                cells.append(f"{p} / {m} / {e:+.1f}%")
                errors.append(e)
            else:
                cells.append("—")
        span = f"{min(errors):+.1f}…{max(errors):+.1f}%" if errors else "—"
        print(f"| {name} | " + " | ".join(cells) + f" | {span} |")
    within = [sum(1 for v in r.values() if abs(v[2]) <= 25) for r in rounds]
    print()
    print("Within 25% of the median step: " + ", ".join(f"{w} of {len(r)}" for w, r in zip(within, rounds)))
    if all(v[3] is not None for r in rounds for v in r.values()):
        means = [sum(1 for v in r.values() if abs(v[3]) <= 25) for r in rounds]
        print("Within 25% of the mean step (T/N): " + ", ".join(f"{w} of {len(r)}" for w, r in zip(means, rounds)))


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(sys.argv[1:])
