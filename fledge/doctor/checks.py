"""A check's result (PASS / WARN / FAIL with one line of why and the fix) and the report.

The doctor's checkpoint checks, the launch-line lint and the live probe all produce `Check`s
into one list, which `report` prints.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

PASS, WARN, FAIL = "PASS", "WARN", "FAIL"
STATUSES = (PASS, WARN, FAIL)  # by severity: the index is the exit code


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
    return max((STATUSES.index(c.status) for c in results), default=0)


def report(results: list[Check], as_json: bool = False, out=print) -> int:
    """Print the results as a table (or JSON) and return the exit code."""
    code = exit_code(results)
    if as_json:
        out(json.dumps({"status": STATUSES[code], "exit_code": code, "checks": [asdict(c) for c in results]},
                       indent=2))
        return code
    width = max((len(c.name) for c in results), default=5)
    out(f"{'CHECK':<{width}}  STATUS  WHY")
    for c in results:
        out(f"{c.name:<{width}}  {c.status:<6}  {c.why}")
        if c.fix and c.status != PASS:
            out(f"{'':<{width}}          fix: {c.fix}")
    counts = [sum(c.status == s for c in results) for s in STATUSES]
    out(f"\n{counts[0]} pass, {counts[1]} warn, {counts[2]} fail -> exit {code}")
    return code
