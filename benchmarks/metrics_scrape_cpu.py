"""CPU per ``/metrics`` scrape of a busy simulated replica: prometheus_client vs the cached page.

One ``SimReplica`` (the live sweep's profile and KV capacity, 16 model seconds per wall second)
runs in this process on a hand-driven clock, with no HTTP: requests of 12 growing conversations
are kept in flight until a few hundred finished, then each round scrapes it ``--scrapes`` times
two ways, in turn:

  generate_latest  prometheus_client's text of ``SimCollector`` (what ``/metrics`` served before)
  page             ``MetricsPage.render()`` (what it serves now)

``busy``: 0.25 wall seconds (a 4 Hz poller) pass between scrapes and requests keep arriving, so
the gauges and histograms move between scrapes; ``still``: the clock stands still, the page does
not change. Every scrape checks the two texts are the same bytes. CPU is this process's
(``time.process_time``) around each render only; the model's own work between scrapes is not
counted.

    python benchmarks/metrics_scrape_cpu.py [--rounds 3] [--scrapes 200] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

from prometheus_client import CollectorRegistry, generate_latest

from kvrouter.loadtest import tokenizer
from kvrouter.loadtest.profiles import Profile, load_profile
from kvrouter.loadtest.sim_metrics import SimCollector
from kvrouter.loadtest.sim_replica import SimReplica

PROFILE = "kimi-k2.6-b200-tp4"
KV_TOKENS = 216_416  # the live sweep's 4-session capacity at 4 chars per token
TIME_SCALE = 16.0
IN_FLIGHT = 12
POLL_WALL_S = 0.25


class Busy:
    def __init__(self, seed: int) -> None:
        profile = load_profile(PROFILE)
        profile = Profile.model_validate({**profile.model_dump(), "max_total_num_tokens": KV_TOKENS,
                                          "gpu_free_gib": None})
        self.t = 0.0
        self.sim = SimReplica(profile, time_scale=TIME_SCALE, clock=lambda: self.t, context_length=4_000_000)
        self.rng = random.Random(seed)
        self.sessions = [tokenizer.synthetic_text(2000, s) for s in range(12)]
        self.submitted = 0

    def top_up(self) -> None:
        while len(self.sim.running_rids()) < IN_FLIGHT:
            s = self.rng.randrange(len(self.sessions))
            grown = self.sessions[s] + tokenizer.synthetic_text(self.rng.randint(200, 2000), self.submitted)
            self.sessions[s] = grown[-60_000:]
            self.sim.submit(prompt_text=self.sessions[s], max_new_tokens=self.rng.randint(50, 400),
                            stream=self.rng.random() < 0.8)
            self.submitted += 1

    def advance(self, wall_s: float) -> None:
        self.t += wall_s
        self.sim.poll()

    @property
    def finished(self) -> int:
        return self.submitted - len(self.sim.running_rids())


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--scrapes", type=int, default=200)
    p.add_argument("--warm-finished", type=int, default=300, help="requests finished before measuring")
    p.add_argument("--json", help="write every round's figures here")
    args = p.parse_args(argv)
    load_start = os.getloadavg()
    busy = Busy(seed=0)
    while busy.finished < args.warm_finished:
        busy.top_up()
        busy.advance(0.05)
    reference = CollectorRegistry(auto_describe=False)
    reference.register(SimCollector(busy.sim))  # type: ignore[arg-type]
    page = busy.sim.metrics_page
    ratios: dict[str, list[float]] = {"busy": [], "still": []}
    rounds: list[dict[str, object]] = []
    for rnd in range(args.rounds):
        for mode in ("busy", "still"):
            cost = {"generate_latest": 0.0, "page": 0.0}
            for _ in range(args.scrapes):
                if mode == "busy":
                    busy.top_up()
                    busy.advance(POLL_WALL_S)
                c0 = time.process_time()
                old = generate_latest(reference)
                c1 = time.process_time()
                new = page.render()
                c2 = time.process_time()
                assert old == new, "the page differs from prometheus_client's text"
                cost["generate_latest"] += c1 - c0
                cost["page"] += c2 - c1
            ms = {k: 1e3 * v / args.scrapes for k, v in cost.items()}
            ratios[mode].append(ms["generate_latest"] / ms["page"])
            rounds.append({"round": rnd, "mode": mode, "ms_per_scrape": ms, "page_bytes": len(new),
                           "finished": busy.finished})
            print(f"round {rnd} {mode:5s}: generate_latest {ms['generate_latest']:.3f} ms, page {ms['page']:.3f} ms "
                  f"per scrape ({ratios[mode][-1]:.1f}x), {len(new)} bytes, {busy.finished} finished")
    for mode, rs in ratios.items():
        print(f"{mode}: page {statistics.median(rs):.1f}x cheaper (median of {len(rs)} rounds, {min(rs):.1f}-{max(rs):.1f}x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": " ".join(["python benchmarks/metrics_scrape_cpu.py", *(sys.argv[1:] if argv is None else argv)]),
                       "settings": {"rounds": args.rounds, "scrapes": args.scrapes,
                                    "warm_finished": args.warm_finished},
                       "cpus": os.cpu_count(), "load_average": {"start": load_start, "end": os.getloadavg()},
                       "rounds": rounds, "ratio_median": {m: statistics.median(rs) for m, rs in ratios.items()}},
                      f, indent=1)


if __name__ == "__main__":
    main()
