"""MkDocs hook: the pages generated from the code at build time (nothing generated is kept in
the repository, so nothing can go stale).

* ``reference/cli.md`` — every ``millpond`` command, from its own argparse parser
  (``millpond.cli.main.command_parser``): usage, arguments, options, defaults;
* ``reference/config.md`` — every field of ``QueueLocation``, ``ProducerConfig``,
  ``ConsumerConfig``, ``GarbageCollectorConfig`` and ``RetryPolicy`` (type, default, and the
  attribute docstring under the field, read with ``ast``), and the Spark data source's own
  options (the table in ``millpond.producer.spark.options``' docstring);
* ``architecture.md`` — ``ARCHITECTURE.md`` as it is;
* ``performance/*.png`` — the charts in ``bench/results/``.

Hand-written pages ask for generated tables with a comment on a line of its own:
``<!-- millpond:bench-summary -->`` (the summary of ``bench/results/summary.json``),
``<!-- millpond:bench NAME -->`` (one benchmark's headline, notes, series and chart) and
``<!-- millpond:types -->`` (what each Spark type becomes, from ``consumer/sinks/types.py``)
and ``<!-- millpond:metrics -->`` (every exported metric, from the catalog in
``millpond.common.exposition``).
A page asking for something that does not exist fails the build.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import enum
import inspect
import json
import re
from pathlib import Path
from typing import Any

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
_MARKER = re.compile(r"^<!-- millpond:([a-z-]+)(?: ([\w@.-]+))? -->$", re.MULTILINE)
_EXIT_CODES = (
    "Exit codes: 0 success, 1 an error (one line on stderr), 2 bad usage (a bad option or "
    "value, one line on stderr), 3 fenced by a newer consumer."
)


def on_files(files: Files, config: MkDocsConfig) -> Files:
    """Add the generated pages and the benchmark charts to the site."""
    generated = {
        "reference/cli.md": cli_reference(),
        "reference/config.md": config_reference(),
        "architecture.md": (ROOT / "ARCHITECTURE.md").read_text(),
    }
    for uri, content in generated.items():
        files.append(File.generated(config, uri, content=content))
    for chart in sorted(RESULTS.glob("*.png")):
        files.append(File.generated(config, f"performance/{chart.name}", abs_src_path=str(chart)))
    return files


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    """Replace each ``<!-- millpond:... -->`` line with what it asks for."""
    del config, files

    def expand(match: re.Match[str]) -> str:
        kind, name = match.group(1), match.group(2)
        if kind == "bench-summary":
            return bench_summary()
        if kind == "bench" and name:
            return bench_section(name)
        if kind == "types":
            from millpond.consumer.sinks.types import mapping_markdown

            return mapping_markdown()
        if kind == "metrics":
            return metrics_table()
        raise PluginError(f"{page.file.src_uri}: unknown generated block {match.group(0)}")

    return _MARKER.sub(expand, markdown)


# -- the command line -----------------------------------------------------------------------


def cli_reference() -> str:
    """Every ``millpond`` command: what it does, its usage, its arguments and options."""
    from millpond.cli.main import build_parser, command_parser, command_summaries

    top = build_parser([])
    lines = [
        "# Command line",
        "",
        "Every `millpond` command with every option, generated from the command line's own "
        "parsers when these pages are built. `millpond COMMAND --help` prints the same.",
        "",
        _EXIT_CODES,
        "",
        "Options of `millpond` itself, given before the command:",
        "",
        *_options_table(top, skip={"command"}),
    ]
    for name, summary in command_summaries().items():
        parser = command_parser(name)
        parser.formatter_class = lambda prog: argparse.HelpFormatter(prog, width=88)
        lines += ["", f"## millpond {name}", "", _cell(summary).capitalize() + ".", ""]
        lines += ["```text", parser.format_usage().rstrip(), "```", ""]
        lines += _options_table(parser, skip=set())
    return "\n".join(lines) + "\n"


def _options_table(parser: argparse.ArgumentParser, skip: set[str]) -> list[str]:
    formatter = parser._get_formatter()
    rows = ["| argument | what it does | default |", "|---|---|---|"]
    for action in parser._actions:
        if action.help == argparse.SUPPRESS or action.dest in skip or action.dest == "help":
            continue
        names = ", ".join(action.option_strings) or (action.metavar or action.dest)
        if action.option_strings and action.nargs != 0:
            metavar = formatter._get_default_metavar_for_optional(action)
            names += f" {formatter._format_args(action, metavar)}"
        what = formatter._expand_help(action) if action.help else ""
        if action.choices and not action.help:
            what = "one of " + ", ".join(f"`{c}`" for c in action.choices)
        if action.required and action.option_strings:
            what = f"required; {what}" if what else "required"
        rows.append(f"| `{_cell(names, code=True)}` | {_cell(what)} | {_default(action)} |")
    return rows


def _default(action: argparse.Action) -> str:
    default = action.default
    if action.nargs == 0 or default in (None, argparse.SUPPRESS, [], ""):
        return ""
    return f"`{_cell(str(default), code=True)}`"


def _cell(text: str, *, code: bool = False) -> str:
    """Text for a Markdown table cell: one line, ``|`` escaped, no HTML tags."""
    text = " ".join(text.split()).replace("|", "\\|")
    return text if code else text.replace("<", "&lt;").replace(">", "&gt;")


def metrics_table() -> str:
    """Every exported metric, from ``millpond.common.exposition.CATALOG``."""
    from millpond.common.exposition import CATALOG

    rows = ["| metric | type | exported by | what |", "|---|---|---|---|"]
    for spec in CATALOG.values():
        labels = f"{{{','.join(spec.labels)}}}" if spec.labels else ""
        rows.append(
            f"| `{spec.name}{labels}` | {spec.kind.value} | {spec.exported_by} "
            f"| {_cell(spec.help)} |"
        )
    return "\n".join(rows)


# -- configuration --------------------------------------------------------------------------


def config_reference() -> str:
    """Every field of every role's configuration, with its type, default and docstring."""
    from millpond.common.retry import RetryPolicy
    from millpond.consumer import ConsumerConfig
    from millpond.gc import GarbageCollectorConfig
    from millpond.producer.config import ProducerConfig
    from millpond.queue import QueueLocation

    sections = [
        (QueueLocation, "Where a queue lives; every configuration below takes these fields."),
        (ProducerConfig, "`Producer(ProducerConfig(...))`, and each Spark write's options."),
        (ConsumerConfig, "`Consumer(ConsumerConfig(...))`; `millpond consume` sets them too."),
        (GarbageCollectorConfig, "`GarbageCollector(GarbageCollectorConfig(...))`."),
        (RetryPolicy, "`ProducerConfig(retry=...)`; as options, `retry.<field>`."),
    ]
    lines = [
        "# Configuration",
        "",
        "Every configuration field, generated from the dataclasses and the docstring under each "
        "field when these pages are built. A bad value raises `ConfigError` naming the field.",
    ]
    for cls, intro in sections:
        lines += ["", f"## {cls.__name__}", "", intro, ""]
        lines += _fields_table(cls, inherited=cls is not QueueLocation)
    lines += ["", *spark_options()]
    return "\n".join(lines) + "\n"


def _fields_table(cls: type, *, inherited: bool) -> list[str]:
    docs, types = _field_docs(cls)
    rows = ["| field | type | default | what |", "|---|---|---|---|"]
    for item in dataclasses.fields(cls):
        if item.name not in docs:
            if not inherited:
                raise PluginError(f"{cls.__name__}.{item.name}: no docstring under the field")
            continue  # a base class's field, documented there
        rows.append(
            f"| `{item.name}` | `{_cell(types[item.name], code=True)}` | {_field_default(item)} "
            f"| {_cell(_rst_to_markdown(docs[item.name]))} |"
        )
    return rows


def _field_docs(cls: type) -> tuple[dict[str, str], dict[str, str]]:
    """The docstring under each field the class itself declares, and its annotation."""
    tree = ast.parse(Path(inspect.getsourcefile(cls) or "").read_text())
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls.__name__)
    docs: dict[str, str] = {}
    types: dict[str, str] = {}
    for item, after in zip(node.body, [*node.body[1:], None], strict=True):
        if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            types[item.target.id] = ast.unparse(item.annotation)
            if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
                docs[item.target.id] = inspect.cleandoc(str(after.value.value))
    return docs, types


def _field_default(item: dataclasses.Field[Any]) -> str:
    if item.default is not dataclasses.MISSING:
        value = item.default
    elif item.default_factory is not dataclasses.MISSING:
        value = item.default_factory()
        if not isinstance(value, (int, float, str, bool, dict, list, tuple)):
            return f"`{type(value).__name__}()`"
    else:
        return "required"
    if isinstance(value, enum.Enum):  # as the option is spelt: "none", "zstd"
        value = value.value if isinstance(value.value, str) else value.name.lower()
    return f"`{_cell(repr(value), code=True)}`"


def _rst_to_markdown(text: str) -> str:
    """Docstring markup into Markdown: ``code`` and :role:`target` become `code`."""
    text = re.sub(r":\w+:`~?([^`]+)`", r"`\1`", text)
    return text.replace("``", "`")


def spark_options() -> list[str]:
    """The options only the Spark data source reads, from the table in the docstring of
    ``millpond.producer.spark.options``."""
    from millpond.producer.spark import options

    rows = ["## Spark options", ""]
    rows.append(
        '`df.write.format("millpond").option(KEY, VALUE)`: every `ProducerConfig` field '
        "above (`flush_size_bytes`, `batch_compression`, ..., `retry.<field>`), every store "
        "option (`aws_*`, `azure_*`, `google_*` keys, as `store_options` takes them), and these:"
    )
    rows += ["", "| option | what |", "|---|---|"]
    table = re.search(r"^(=+ =+)\n(.*?)\n\1\n", options.__doc__ or "", re.S | re.M)
    if table is None:
        raise PluginError("millpond.producer.spark.options: its option table was not found")
    width = len(table.group(1).split()[0]) + 1
    entries: list[list[str]] = []
    for line in table.group(2).splitlines():
        key, text = line[:width].strip(), line[width:].strip()
        if key:
            entries.append([key, text])
        elif entries:
            entries[-1][1] += " " + text
    rows += [f"| {_rst_to_markdown(k)} | {_cell(_rst_to_markdown(t))} |" for k, t in entries]
    return rows


# -- benchmarks -----------------------------------------------------------------------------


def _result(name: str) -> dict[str, Any]:
    path = RESULTS / f"{name}.json"
    if not path.is_file():
        raise PluginError(f"no benchmark result {path.relative_to(ROOT)}")
    result: dict[str, Any] = json.loads(path.read_text())
    return result


def bench_summary() -> str:
    """One row per benchmark of ``summary.json``: its ratio against a baseline measured in the
    same run, the target, whether it was met, and its headline."""
    summary = _result("summary")
    rows = [
        f"From one `make bench` on {summary['machine']['cpus']} cores, finished "
        f"{summary['finished_at'].replace('T', ' ')[:16]} UTC (Python "
        f"{summary['machine']['python']}):",
        "",
        "| benchmark | ratio | target | met | what was measured |",
        "|---|---|---|---|---|",
    ]
    rows += [_summary_row(bench) for bench in summary["benchmarks"]]
    return "\n".join(rows)


def _summary_row(bench: dict[str, Any]) -> str:
    op = {"<=": "≤", ">=": "≥"}.get(bench["target_op"], bench["target_op"])
    passed = bench.get("passed")
    if passed is None:
        ratio, target = bench["ratio"], bench["target"]
        passed = ratio <= target if bench["target_op"] == "<=" else ratio >= target
    met = "yes" if passed else "**no**"
    return (
        f"| `{bench['name']}` | {bench['ratio']:.2f} | {op} {bench['target']:g} | {met} "
        f"| {_cell(bench['headline'])} |"
    )


def bench_section(name: str) -> str:
    """One benchmark: headline, how its ratio is judged, its series as tables, its chart."""
    result = _result(name)
    lines = [f"**{_cell(result['headline'])}**", ""]
    if result.get("notes"):
        lines += [_cell(result["notes"]), ""]
    for series in result.get("series", []):
        lines += _series_table(series)
    chart = RESULTS / f"{name}.png"
    if chart.is_file():
        lines += [f"![{name}](performance/{chart.name})", ""]
    return "\n".join(lines)


def _series_table(series: dict[str, Any]) -> list[str]:
    """A series as a table, x down the side; long ones (time series) are left to the chart."""
    xs = series["x"]
    if len(xs) > 12:
        return []
    names = list(series["lines"])
    head = f"| {_cell(series['x_label'])} | " + " | ".join(_cell(n) for n in names) + " |"
    rows = [f"*{_cell(series['title'])}* ({_cell(series['y_label'])})", "", head]
    rows.append("|" + "---|" * (len(names) + 1))
    for i, x in enumerate(xs):
        values = [_number(series["lines"][n][i]) for n in names]
        rows.append(f"| {_number(x)} | " + " | ".join(values) + " |")
    return [*rows, ""]


def _number(value: Any) -> str:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return _cell(str(value))
    if abs(value) >= 100:
        return f"{value:,.0f}"
    return f"{value:.3g}"
