"""Print what a profile predicts, as a markdown table.

    python -m kvrouter.loadtest.profile_table [--profile NAME ...]
"""

from __future__ import annotations

import argparse

from . import timing
from .profiles import DEFAULT_PROFILE, Profile, load_profile

SESSION = 100_000  # tokens of a long coding-agent session (workload.md)


def rows(p: Profile) -> list[tuple[str, str]]:
    cold = timing.chunked_prefill_time(p, SESSION, 0)
    warm = timing.chunked_prefill_time(p, 2_000, 98_000)
    out: list[tuple[str, str]] = [
        ("KV capacity (tokens)", f"{p.max_total_num_tokens:,}"),
        ("100k-token sessions that fit", f"{p.max_total_num_tokens // SESSION}"),
        ("TTFT cold, 100k prompt", f"{cold:.2f} s"),
        ("TTFT warm, 2k new on 98k cached", f"{warm:.3f} s ({cold / warm:.0f}x cheaper)"),
    ]
    if p.host_total_num_tokens:
        host = timing.chunked_prefill_time(p, 2_000, 98_000, load_back_tokens=98_000)
        out.append(("TTFT host hit, 98k loaded back + 2k new", f"{host:.3f} s"))
        out.append(("Host tier capacity (tokens)", f"{p.host_total_num_tokens:,}"))
        # write_through mirrors device pages on host: distinct tokens are bounded by the host pool
        unique = (max(p.host_total_num_tokens, p.max_total_num_tokens) if p.hicache_write_through
                  else p.host_total_num_tokens + p.max_total_num_tokens)
        policy = "write_through" if p.hicache_write_through else "write_back"
        out.append(("Distinct cached tokens, device + host", f"{unique:,} ({policy})"))
    out.append(("Prefill tok/s per GPU, cold 100k", f"{SESSION / cold / p.gpus:,.0f}"))
    for b in (1, 8, 32):
        per_user = timing.decode_tokens_per_s_per_user(p, b, SESSION)
        fits = "" if b * SESSION <= p.max_total_num_tokens else " (exceeds KV capacity)"
        out.append(
            (f"Decode tok/s per user, batch {b}, 100k context",
             f"{per_user:.0f} (replica {per_user * b:,.0f}){fits}")
        )
    b = p.max_running_requests
    per_user = timing.decode_tokens_per_s_per_user(p, b, 4_000)
    out.append(
        ("Decode at full batch (max_running_requests), 4k context: tok/s per user / per GPU",
         f"B={b}: {per_user:.0f} / {per_user * b / p.gpus:,.0f}")
    )
    return out


def table(profiles: list[Profile]) -> str:
    lines = ["| | " + " | ".join(f"`{p.name}`" for p in profiles) + " |"]
    lines.append("|---" * (len(profiles) + 1) + "|")
    columns = [rows(p) for p in profiles]
    for i, (label, _) in enumerate(columns[0]):
        cells = []
        for col in columns:
            match = [v for k, v in col if k == label]
            cells.append(match[0] if match else "-")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    labels = {k for k, _ in columns[0]}
    for col in columns[1:]:  # rows only some profiles have (host tier)
        for label, _ in col:
            if label not in labels:
                labels.add(label)
                cells = [dict(c).get(label, "-") for c in columns]
                lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", action="append", help=f"profile name or YAML path (default {DEFAULT_PROFILE})")
    args = ap.parse_args(argv)
    print(table([load_profile(n) for n in (args.profile or [DEFAULT_PROFILE])]))


if __name__ == "__main__":
    main()
