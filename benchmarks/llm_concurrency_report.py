"""llm_concurrency.py's report: medians over runs, ratios, issue 13's targets, the table and
the JSON line."""

from __future__ import annotations

import argparse
import json
import re
import statistics
from typing import Any

from common import BENCH, fmt
from llm_concurrency_plan import Scenario

RESULTS_MD = BENCH / "RESULTS.md"


FIGS = ("agg_tokens_per_s", "ttft_p50_s", "ttft_p90_s", "itl_p50_ms", "itl_p99_ms", "peak_rss_mib")
HIGHER_BETTER = {"agg_tokens_per_s"}


def median_runs(runs: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per system and scenario, the median of each figure over the runs that produced it."""
    merged: dict[str, dict[str, Any]] = {}
    systems = {s for run in runs for s in run}
    for system in systems:
        per = [run[system] for run in runs if system in run]
        if any("error" in p for p in per):
            errors = [p["error"] for p in per if "error" in p]
            if all("error" in p for p in per):
                merged[system] = {"error": errors[0]}
                continue
            per = [p for p in per if "error" not in p]
        keys = {k for p in per for k in p}
        merged[system] = {}
        for key in keys:
            rows = [p[key] for p in per if key in p]
            fig: dict[str, Any] = {}
            for name in (*FIGS, "tokens", "errors", "wall_s"):
                values = [r[name] for r in rows if r.get(name) is not None]
                fig[name] = round(statistics.median(values), 3) if values else None
            for name in ("token_source", "first_error"):
                found = [r[name] for r in rows if r.get(name)]
                if found:
                    fig[name] = found[0]
            fig["runs"] = len(rows)
            merged[system][key] = fig
    return merged


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b rounded, None when either is missing or b is 0."""
    return round(a / b, 3) if a is not None and b else None


def ratios(res: dict[str, dict[str, Any]], scenarios: list[Scenario]) -> dict[str, Any]:
    """ours/torchserve per figure and scenario, ours/static aggregate (together), ours(N)/ours(1) aggregate."""
    ours = res.get("ours", {})
    out: dict[str, Any] = {}
    if "error" in ours or not ours:
        return out
    ts = res.get("torchserve", {})
    static = res.get("static", {})
    base = ours.get("together/1", {}).get("agg_tokens_per_s")
    for sc in scenarios:
        mine = ours.get(sc.key, {})
        row: dict[str, Any] = {}
        if ts and "error" not in ts and sc.key in ts:
            for name in FIGS:
                row[f"{name}_vs_torchserve"] = ratio(mine.get(name), ts[sc.key].get(name))
        if static and "error" not in static and sc.key in static:
            row["agg_vs_static"] = ratio(mine.get("agg_tokens_per_s"), static[sc.key].get("agg_tokens_per_s"))
        row["agg_vs_ours_1"] = ratio(mine.get("agg_tokens_per_s"), base)
        out[sc.key] = row
    return out


def results_md_before() -> dict[str, float] | None:
    """The single-stream LLM figures recorded in RESULTS.md (tokens/s, TTFT s), if present."""
    try:
        text = RESULTS_MD.read_text()
    except OSError:
        return None
    tps = re.search(r"\(d\) LLM 64 tokens streamed, tokens/s\s+([\d.]+)", text)
    ttft = re.search(r"\(d\) LLM time to first token, s\s+([\d.]+)", text)
    if not tps or not ttft:
        return None
    return {"agg_tokens_per_s": float(tps.group(1)), "ttft_p50_s": float(ttft.group(1))}


def check_targets(res: dict[str, dict[str, Any]], scenarios: list[Scenario], top_n: int) -> list[dict[str, Any]]:
    """Issue 13's targets on the (median) figures: ``{"target", "status": met|MISSED|n/a, "detail"}``."""
    ours = res.get("ours", {}) if "error" not in res.get("ours", {}) else {}
    static = res.get("static", {}) if "error" not in res.get("static", {}) else {}
    ts = res.get("torchserve", {}) if "error" not in res.get("torchserve", {}) else {}
    together, staggered, one = f"together/{top_n}", f"staggered/{top_n}", "together/1"
    out: list[dict[str, Any]] = []

    def add(target: str, value: float | None, limit: float | None, op: str, detail: str = "") -> None:
        if value is None or limit is None:
            out.append({"target": target, "status": "n/a", "detail": detail or "not measured"})
            return
        ok = value >= limit if op == ">=" else value <= limit
        out.append({"target": target, "status": "met" if ok else "MISSED",
                    "detail": f"{value:g} {op} {limit:g}" + (f" ({detail})" if detail else "")})

    def get(system: dict[str, Any], key: str, name: str) -> float | None:
        return system.get(key, {}).get(name)

    static_agg = get(static, together, "agg_tokens_per_s")
    add(f"{top_n} together: aggregate >= 0.8x static batch", get(ours, together, "agg_tokens_per_s"),
        None if static_agg is None else round(0.8 * static_agg, 2), ">=", f"static {static_agg}")
    add(f"{top_n} together: TTFT p50 <= 1 s", get(ours, together, "ttft_p50_s"), 1.0, "<=")
    add(f"{top_n} together: TTFT p90 <= 2 s", get(ours, together, "ttft_p90_s"), 2.0, "<=")
    add(f"{top_n} together: ITL p99 <= 250 ms", get(ours, together, "itl_p99_ms"), 250.0, "<=")
    add(f"{top_n} staggered: TTFT p90 <= 1 s", get(ours, staggered, "ttft_p90_s"), 1.0, "<=")
    one_agg = get(ours, one, "agg_tokens_per_s")
    add(f"{top_n} staggered: aggregate >= 2x one stream's", get(ours, staggered, "agg_tokens_per_s"),
        None if one_agg is None else round(2 * one_agg, 2), ">=", f"one stream {one_agg}")
    before = res.get("before", {})
    if before and "error" not in before and one in before:
        base, source = before[one], "--before-tree, same run"
    else:
        base, source = results_md_before() or {}, "RESULTS.md's llm_bench figure (chat prompt of 42 tokens)"
    add("one stream: tokens/s >= 0.95x before", one_agg,
        None if base.get("agg_tokens_per_s") is None else round(0.95 * base["agg_tokens_per_s"], 2), ">=", source)
    base_ttft = base.get("ttft_p50_s")
    add("one stream: TTFT <= 1.1x before", get(ours, one, "ttft_p50_s"),
        None if base_ttft is None else round(1.1 * base_ttft, 3), "<=", source)
    rss1 = get(ours, one, "peak_rss_mib")
    add(f"worker peak RSS with {top_n} streams <= 1.5x with one", get(ours, together, "peak_rss_mib"),
        None if rss1 is None else round(1.5 * rss1, 1), "<=", f"one stream {rss1} MiB")
    for name in FIGS:
        pairs = [(sc.key, get(ours, sc.key, name), get(ts, sc.key, name)) for sc in scenarios]
        pairs = [(k, a, b) for k, a, b in pairs if a is not None and b is not None]
        target = f"ahead of TorchServe: {name}"
        if not pairs:
            out.append({"target": target, "status": "n/a", "detail": "not measured"})
            continue
        better = [(a > b) if name in HIGHER_BETTER else (a < b) for _, a, b in pairs]
        behind = [f"{k} {a:g} vs {b:g}" for (k, a, b), ok in zip(pairs, better, strict=True) if not ok]
        out.append({"target": target, "status": "met" if all(better) else "MISSED",
                    "detail": f"{len(pairs) - len(behind)}/{len(pairs)} scenarios"
                    + (f"; behind: {', '.join(behind)}" if behind else "")})
    return out


def print_report(res: dict[str, dict[str, Any]], scenarios: list[Scenario], args: argparse.Namespace,
                 notes: list[str]) -> None:
    """The table, ratios, targets and the JSON line."""
    print(f"SmolLM2-135M-Instruct, {args.max_new_tokens} tokens per stream (ignore_eos, greedy), "
          f"{'median of ' + str(args.runs) + ' runs' if args.runs > 1 else '1 run'}, this machine")
    for note in notes:
        print(f"note: {note}")
    head = (f"{'system':<11}{'arrival':<10}{'N':>3}{'agg tok/s':>11}{'TTFT p50':>10}{'TTFT p90':>10}"
            f"{'ITL p50ms':>11}{'ITL p99ms':>11}{'RSS MiB':>9}{'tokens':>8}{'err':>5}")
    print(head)
    print("-" * len(head))
    for system in args.systems:
        rows = res.get(system)
        if rows is None:
            continue
        if "error" in rows:
            print(f"{system:<11}failed: {rows['error']}")
            continue
        for sc in scenarios:
            r = rows.get(sc.key)
            if r is None:
                continue
            print(f"{system:<11}{sc.arrival:<10}{sc.n:>3}{fmt(r['agg_tokens_per_s'], 11, 2)}"
                  f"{fmt(r['ttft_p50_s'], 10, 3)}{fmt(r['ttft_p90_s'], 10, 3)}{fmt(r['itl_p50_ms'], 11, 1)}"
                  f"{fmt(r['itl_p99_ms'], 11, 1)}{fmt(r['peak_rss_mib'], 9, 0)}{fmt(r['tokens'], 8, 0)}"
                  f"{fmt(r['errors'], 5, 0)}")
            if r.get("first_error"):
                print(f"{'':24}first error: {r['first_error'][:150]}")
    rat = ratios(res, scenarios)
    if rat:
        print("\nratios (ours / other; tokens/s: higher is better, the rest: lower is better)")
        print(f"{'arrival':<10}{'N':>3}{'agg/TS':>8}{'TTFT50/TS':>10}{'TTFT90/TS':>10}{'ITL50/TS':>9}"
              f"{'ITL99/TS':>9}{'RSS/TS':>8}{'agg/static':>11}{'agg/ours(1)':>12}")
        for sc in scenarios:
            r = rat.get(sc.key, {})
            cells = [r.get(f"{n}_vs_torchserve") for n in FIGS]
            print(f"{sc.arrival:<10}{sc.n:>3}{fmt(cells[0], 8, 2)}{fmt(cells[1], 10, 2)}{fmt(cells[2], 10, 2)}"
                  f"{fmt(cells[3], 9, 2)}{fmt(cells[4], 9, 2)}{fmt(cells[5], 8, 2)}"
                  f"{fmt(r.get('agg_vs_static'), 11, 2)}{fmt(r.get('agg_vs_ours_1'), 12, 2)}")
    top_n = max(s.n for s in scenarios)
    targets = check_targets(res, scenarios, top_n)
    print(f"\ntargets (issue 13; the full ones need N up to 8 and 64 tokens: this run has N up to {top_n}, "
          f"{args.max_new_tokens} tokens)")
    for t in targets:
        print(f"{t['status']:<7} {t['target']}: {t['detail']}")
    print(json.dumps({"scenario": "llm_concurrency", "runs": args.runs, "max_new_tokens": args.max_new_tokens,
                      "concurrency": args.concurrency, "mean_gap_s": args.mean_gap, "seed": args.seed,
                      "ts_api": args.ts_api, "results": res, "ratios": rat, "targets": targets, "notes": notes}))
