"""A check's result (PASS / WARN / FAIL with one line of why and the fix), and the report.

Shared by the doctor's checkpoint checks and the launch-line lint; anything else that
produces checks (a live acceptance probe) appends to the same list before `report`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

PASS, WARN, FAIL = "PASS", "WARN", "FAIL"
_SEVERITY = {PASS: 0, WARN: 1, FAIL: 2}


@dataclass
class Check:
    name: str
    status: str  # PASS / WARN / FAIL
    why: str
    fix: str = ""


def ok(name, why):
    return Check(name, PASS, why)


def warn(name, why, fix=""):
    return Check(name, WARN, why, fix)


def fail(name, why, fix=""):
    return Check(name, FAIL, why, fix)


def exit_code(results: list[Check]) -> int:
    return max((_SEVERITY[c.status] for c in results), default=0)


def report(results: list[Check], as_json: bool = False, out=print) -> int:
    """Print the results as a table (or JSON) and return the exit code."""
    code = exit_code(results)
    if as_json:
        out(json.dumps({"status": [PASS, WARN, FAIL][code], "exit_code": code,
                        "checks": [asdict(c) for c in results]}, indent=2))
        return code
    width = max((len(c.name) for c in results), default=5)
    out(f"{'CHECK':<{width}}  STATUS  WHY")
    for c in results:
        out(f"{c.name:<{width}}  {c.status:<6}  {c.why}")
        if c.fix and c.status != PASS:
            out(f"{'':<{width}}          fix: {c.fix}")
    counts = {s: sum(c.status == s for c in results) for s in (PASS, WARN, FAIL)}
    out(f"\n{counts[PASS]} pass, {counts[WARN]} warn, {counts[FAIL]} fail -> exit {code}")
    return code
