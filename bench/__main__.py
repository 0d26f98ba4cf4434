"""Run the benchmarks: ``python -m bench [NAME ...] [--quick] [--latency-ms MS] [--out DIR]``.

Discovers every ``bench/bench_*.py`` module and runs each in its own child process (so one
benchmark's servers, threads or crash cannot disturb the next), writes
``<out>/<name>.json``, ``<out>/<name>.png`` when the benchmark returns plot series,
``<out>/summary.json`` and ``<out>/summary.png`` (ratios against targets), and prints a table.

``--latency-ms MS`` runs the benchmarks that use the object store again with every store
request held back ``MS`` milliseconds by the latency proxy (their baselines too); their results
are named ``<name>@<MS>ms`` and merge into the summary next to the loopback rows. A module sets
``USES_STORE = False`` when it never touches the store (skipped in such a pass) and
``DEFAULT_LATENCY_MS`` when it always injects latency of its own (run in the plain pass).

A benchmark that raises, crashes or times out is reported as an error and the others still
run. Exit code: 0 when every benchmark ran (whether or not it met its target), 1 when any
errored, 2 for bad usage.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib
import json
import logging
import os
import platform
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.common import LATENCY_ENV, passed

logger = logging.getLogger("bench")

BENCH_DIR = Path(__file__).resolve().parent
DEFAULT_OUT = BENCH_DIR / "results"
PREFIX = "bench_"


def discover() -> list[str]:
    """Benchmark names (``bench_<name>.py`` -> ``<name>``), sorted."""
    return sorted(p.stem[len(PREFIX) :] for p in BENCH_DIR.glob(f"{PREFIX}*.py"))


def module_flag(name: str, flag: str, default: Any) -> Any:
    """A module-level setting of ``bench_<name>`` (``USES_STORE``, ``DEFAULT_LATENCY_MS``)."""
    module = importlib.import_module(f"bench.{PREFIX}{name}")
    return getattr(module, flag, default)


def result_name(name: str, latency: float) -> str:
    """``name``, or ``name@<latency>ms`` when latency is injected beyond the module's own."""
    if latency <= 0 or latency == module_flag(name, "DEFAULT_LATENCY_MS", 0.0):
        return name
    return f"{name}@{latency:g}ms"


def machine() -> dict[str, Any]:
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
    }


# --- the child: one benchmark ------------------------------------------------------------------


def run_child(name: str, quick: bool, out_file: Path, latency: float) -> int:
    """Import and run one benchmark, writing its result (or its error) to ``out_file``."""
    started = time.monotonic()
    if latency > 0:
        os.environ[LATENCY_ENV] = f"{latency:g}"  # read by bench.common, inherited by workers
    try:
        module = importlib.import_module(f"bench.{PREFIX}{name}")
        result = dict(module.run(quick))
        code = 0
    except BaseException as err:  # report anything, even SystemExit, as this benchmark's error
        result = {
            "name": name,
            "error": f"{type(err).__name__}: {err}",
            "traceback": traceback.format_exc(),
        }
        code = 1
    result["name"] = result_name(name, latency)
    if latency > 0:
        result["latency_ms"] = latency
    result["seconds"] = round(time.monotonic() - started, 2)
    out_file.write_text(json.dumps(result, indent=2, default=str) + "\n")
    return code


# --- the parent: run all, plot, summarise --------------------------------------------------------


def run_one(
    name: str, quick: bool, out: Path, timeout: float, latency: float = 0.0
) -> dict[str, Any]:
    shown = result_name(name, latency)
    result_file = out / f"{shown}.json"
    result_file.unlink(missing_ok=True)
    command = [sys.executable, "-m", "bench", "--child", name, "--out", str(out)]
    if quick:
        command.append("--quick")
    if latency > 0:
        command += ["--latency-ms", f"{latency:g}"]
    started = time.monotonic()
    # Own session: on timeout the whole group (servers, worker processes) goes with it.
    child = subprocess.Popen(command, cwd=BENCH_DIR.parent, start_new_session=True)
    try:
        child.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()
        return {"name": shown, "error": f"timed out after {timeout:.0f} s"}
    except KeyboardInterrupt:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()
        raise
    if not result_file.exists():
        return {
            "name": shown,
            "error": f"exited with code {child.returncode} and wrote no result",
            "seconds": round(time.monotonic() - started, 2),
        }
    result: dict[str, Any] = json.loads(result_file.read_text())
    return result


def finish(result: dict[str, Any], quick: bool, out: Path) -> dict[str, Any]:
    result["quick"] = quick
    result["machine"] = machine()
    result["finished_at"] = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    if "error" not in result:
        result["passed"] = passed(result)
        if result.get("series"):
            try:
                plot_series(result, out / f"{result['name']}.png")
            except Exception as err:
                logger.warning("plot of %s failed: %s", result["name"], err)
    (out / f"{result['name']}.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    return result


def plot_series(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    specs: list[dict[str, Any]] = result["series"]
    fig, axes = plt.subplots(1, len(specs), figsize=(5.5 * len(specs), 4.2), squeeze=False)
    for ax, spec in zip(axes[0], specs, strict=True):
        for label, values in spec["lines"].items():
            ax.plot(spec["x"], values, marker="o", label=label)
        if "hline" in spec:
            ax.axhline(
                spec["hline"]["y"], color="red", linestyle="--", label=spec["hline"]["label"]
            )
        if spec.get("log_x"):
            ax.set_xscale("log", base=2)
            ax.set_xticks(spec["x"], [str(v) for v in spec["x"]])
        if spec.get("log_y"):
            ax.set_yscale("log")
        else:
            ax.set_ylim(bottom=0)
        ax.set_title(spec["title"])
        ax.set_xlabel(spec["x_label"])
        ax.set_ylabel(spec["y_label"])
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(
        f"{result['name']} (ratio {result.get('ratio')}, target {result.get('target_op', '>=')} "
        f"{result.get('target')})"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_summary(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in results if isinstance(r.get("ratio"), (int, float))]
    if not rows:
        return
    fig, ax = plt.subplots(figsize=(max(5.0, 1.6 * len(rows)), 4.2))
    names = [r["name"] for r in rows]
    ratios = [float(r["ratio"]) for r in rows]
    colors = ["tab:green" if r.get("passed") else "tab:red" for r in rows]
    bars = ax.bar(names, ratios, color=colors, alpha=0.8)
    for bar, row in zip(bars, rows, strict=True):
        x0, width = bar.get_x(), bar.get_width()
        ax.hlines(float(row["target"]), x0 - 0.05, x0 + width + 0.05, colors="black", linewidth=2)
        ax.annotate(
            f"{float(row['ratio']):.2f}\n({row.get('target_op', '>=')} {row['target']})",
            (x0 + width / 2, bar.get_height()),
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax.set_ylabel("measured / baseline")
    ax.set_title("Millpond benchmarks: ratio vs target (black bar)")
    top = max([*ratios, *(float(r["target"]) for r in rows)]) * 1.25
    if top > 10 * min(float(r["target"]) for r in rows):
        # A few far-off ratios (latency under contention) would flatten every other bar.
        ax.set_yscale("log")
        ax.set_ylim(min([*ratios, 1.0]) / 2, top * 2)
    else:
        ax.set_ylim(0, top)
    ax.grid(True, axis="y", alpha=0.3)
    plt.setp(ax.get_xticklabels(), rotation=20, ha="right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summary_row(result: dict[str, Any]) -> dict[str, Any]:
    row = {
        key: result.get(key)
        for key in ("name", "ratio", "target", "target_op", "passed", "seconds", "headline")
    }
    if "error" in result:
        row["error"] = result["error"]
    return row


def summary_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The result's row, then one per side target it judged (``make_result(side_rows=)``)."""
    rows = [summary_row(result)]
    if "error" in result:
        return rows
    for side in result.get("side_rows", []):
        row = {
            "name": f"{result['name']}/{side['name']}",
            "ratio": side["ratio"],
            "target": side["target"],
            "target_op": side.get("target_op", ">="),
            "seconds": None,
            "headline": side.get("headline", ""),
        }
        row["passed"] = passed(row)
        rows.append(row)
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    header = f"{'benchmark':<28} {'ratio':>8} {'target':>9} {'result':>7} {'secs':>7}  headline"
    print(header)
    print("-" * len(header))
    for row in rows:
        if "error" in row:
            verdict, ratio, target = "ERROR", "-", "-"
        else:
            verdict = {True: "PASS", False: "MISS", None: "?"}[row["passed"]]
            ratio = f"{row['ratio']:.3f}" if isinstance(row["ratio"], (int, float)) else "-"
            target = f"{row['target_op']} {row['target']}"
        detail = row.get("error") or row.get("headline") or ""
        seconds = row.get("seconds")
        secs = f"{seconds:.0f}" if isinstance(seconds, (int, float)) else "-"
        print(f"{row['name']:<28} {ratio:>8} {target:>9} {verdict:>7} {secs:>7}  {detail}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", metavar="NAME", help="benchmarks to run (default all)")
    parser.add_argument("--quick", action="store_true", help="short runs for a smoke check")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"default {DEFAULT_OUT}")
    parser.add_argument(
        "--timeout",
        type=float,
        default=3600.0,
        help="seconds per benchmark before it is killed (default 3600)",
    )
    parser.add_argument(
        "--latency-ms",
        type=float,
        default=0.0,
        help="hold every object-store request back this long (latency proxy); runs only the "
        "benchmarks that use the store, results named <name>@<MS>ms",
    )
    parser.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--child", metavar="NAME", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    out: Path = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    latency: float = args.latency_ms
    if latency < 0:
        parser.error(f"--latency-ms: expected >= 0, found {latency:g}")
    if args.child:
        shown = result_name(args.child, latency)
        return run_child(args.child, args.quick, out / f"{shown}.json", latency)

    available = discover()
    if args.list:
        print("\n".join(available))
        return 0
    names = [n.removeprefix(PREFIX) for n in args.names] or available
    unknown = sorted(set(names) - set(available))
    if unknown:
        parser.error(
            f"unknown benchmark(s) {', '.join(unknown)}; available: {', '.join(available)}"
        )

    if latency > 0:
        skipped = [n for n in names if not module_flag(n, "USES_STORE", True)]
        if skipped:
            logger.info("--latency-ms: %s never touch the store; skipped", ", ".join(skipped))
        names = [n for n in names if n not in skipped]
        if not args.names:  # these inject latency of their own and ran in the plain pass
            names = [n for n in names if not module_flag(n, "DEFAULT_LATENCY_MS", 0.0)]

    results = []
    for name in names:
        logger.info(
            "benchmark %s (%s%s)",
            name,
            "quick" if args.quick else "full",
            f", {latency:g} ms per store request" if latency > 0 else "",
        )
        result = finish(run_one(name, args.quick, out, args.timeout, latency), args.quick, out)
        if "error" in result:
            logger.error("benchmark %s failed: %s", name, result["error"])
        results.append(result)

    rows = [row for r in results for row in summary_rows(r)]
    summary = {
        "quick": args.quick,
        "machine": machine(),
        "finished_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "benchmarks": rows,
    }
    # A partial run (some names, or the latency pass) merges into the existing summary instead
    # of dropping the rest.
    summary_file = out / "summary.json"
    if (args.names or latency > 0) and summary_file.exists():
        # A benchmark run again replaces all its rows: a side row it no longer judges goes.
        rerun = {r["name"] for r in results}
        with_previous = {
            r["name"]: r
            for r in json.loads(summary_file.read_text()).get("benchmarks", [])
            if r["name"].split("/", 1)[0] not in rerun
        }
        with_previous.update({r["name"]: r for r in rows})
        summary["benchmarks"] = [with_previous[n] for n in sorted(with_previous)]
    summary_file.write_text(json.dumps(summary, indent=2, default=str) + "\n")
    try:
        plot_summary([r for r in summary["benchmarks"] if "error" not in r], out / "summary.png")
    except Exception as err:
        logger.warning("summary plot failed: %s", err)
    print()
    print_table(rows)
    print(f"\nresults in {out}")
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
