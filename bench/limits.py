"""python -m bench.limits: what an agent's limits (uibus.agents.limits: its cgroups, made before it
starts and removed when it ends) add to its start and to its end (docs/hosting/isolation.md, "Limits").

`/bin/true` through the local launcher, with the default limits and with none, interleaved (so drift in
the machine's load hits both alike), medians of --n each:

* start: from the launcher's `start` to the program's exit — the cgroups made (the tenant's and the
  agent's, in each hierarchy) and joined by the agent's shell before it execs;
* launch: the whole `async with`, its end included — what is left in the cgroups killed, the
  directories removed.

Needs writable cgroups (root under cgroup v1, or a delegated v2); says so and exits otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from dataclasses import replace

from uibus.agents import cgroups
from uibus.agents.launcher import Launch
from uibus.agents.limits import DEFAULTS, Limits
from uibus.agents.local_launcher import LOCAL


async def once(limits: Limits | None) -> tuple[float, float]:
    launch = Launch(agent="bench", session="s", tenant="bench", argv=("/bin/true",), cwd="/tmp",
                    env={"PATH": "/usr/bin:/bin"}, limits=limits)
    began = time.perf_counter()
    async with LOCAL.start(launch) as proc:
        await proc.wait()
        up = time.perf_counter() - began
    return up * 1000, (time.perf_counter() - began) * 1000


async def main(n: int) -> dict[str, float]:
    limits = replace(DEFAULTS, disk_mb=0)  # disk is measured by a watch, not made at the start
    runs: dict[str, list[tuple[float, float]]] = {"none": [], "limits": []}
    for i in range(n + 5):  # the first 5 of each warm up
        for key, lim in (("none", None), ("limits", limits)):
            took = await once(lim)
            if i >= 5:
                runs[key].append(took)
    out = {}
    for key, values in runs.items():
        out[f"{key}_start_ms"] = round(statistics.median(v[0] for v in values), 2)
        out[f"{key}_launch_ms"] = round(statistics.median(v[1] for v in values), 2)
    out["start_added_ms"] = round(out["limits_start_ms"] - out["none_start_ms"], 2)
    out["launch_added_ms"] = round(out["limits_launch_ms"] - out["none_launch_ms"], 2)
    assert cgroups.leftovers() == [], cgroups.leftovers()
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=60)
    args = parser.parse_args()
    problems = {c: p for c in cgroups.KINDS if (p := cgroups.HIERARCHIES.problem(c))}
    if problems:
        sys.exit(f"no writable cgroups here: {problems}")
    print(json.dumps(asyncio.run(main(args.n))))
