"""The tables of docs/performance.md, written from the committed results files (benchmarks/results/*.json, in the
format of ../shared/RESULTS.md), so that every number on that page comes from a file and the page is one command away.

    python benchmarks/performance_tables.py                              # print the tables
    python benchmarks/performance_tables.py --write docs/performance.md  # rewrite them in the page
    python benchmarks/performance_tables.py --check docs/performance.md  # exit 1 if the page differs from the files

Each table sits in the page between `<!-- tables:NAME:begin -->` and `<!-- tables:NAME:end -->`; the prose around
them is the page's own. The rules the tables follow:
- A row is the newest `ok` row (by its file's date) per device, workload, geometry, prompts per step P, mode and
  setting: a later run of the same thing replaces an earlier one. The setting is what a run changed from its
  harness's defaults (a flag such as --compact-decode, or the `--set` overrides of the run_train.sh harness), so an
  experiment does not replace the default's row but gets its own.
- "vs serial" divides serial's step time by the row's only where serial ran in the same file ("same run") or on the
  same day and device ("same day"); otherwise the ratio is left out.
- Every row links the results file it comes from, relative to the page.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.mode_ceiling import ceilings  # noqa: E402

MODES = ("serial", "decomposed", "overlapped")
WORKLOAD_ORDER = ("img-small", "img", "vid")
# flags of the earlier harness's command lines that change what a step does, and how the tables name them
SETTING_FLAGS = {"--compact-decode": "compact decode", "--window-sms": "window SMs",
                 "--oom-sites": "allocation stacks recorded (slows the host)"}
TABLES = ("speed", "memory", "mfu", "decode", "ceiling", "recipes", "sglang")
GiB = 2**30


@dataclass(frozen=True)
class Row:
    data: dict  # the row as the benchmark wrote it
    file: Path
    index: int  # its place in the file (a later one of the same key wins)
    topic: str
    device: str
    date: str  # the file's, ISO 8601
    setting: str  # '' for the defaults of its harness

    def get(self, key: str, default=None):
        return self.data.get(key, default)


def setting_of(doc: dict) -> str:
    """What a results file's run changed from its harness's defaults, in words ('' for nothing)."""
    words = [label for flag, label in SETTING_FLAGS.items() if flag in doc.get("command", "").split()]
    overrides = doc.get("overrides") or []
    return ", ".join(words + [str(o) for o in overrides])


def load(results: Path) -> list[Row]:
    """Every row of every results file under `results` (files without `rows` are not results files)."""
    rows = []
    for path in sorted(results.resolve().glob("*.json")):
        doc = json.loads(path.read_text())
        if not isinstance(doc, dict) or not isinstance(doc.get("rows"), list):
            continue
        for i, data in enumerate(doc["rows"]):
            rows.append(Row(data, path, i, doc.get("topic", ""), doc.get("device", ""), doc.get("date", ""),
                            setting_of(doc)))
    return rows


def newest(rows: list[Row], key, ok_only: bool = True) -> list[Row]:
    """The newest row per key(row), of the ok ones unless `ok_only` is off: by file date, then file name, then place
    in the file."""
    best: dict = {}
    for r in sorted((r for r in rows if r.get("ok") or not ok_only), key=lambda r: (r.date, r.file.name, r.index)):
        best[key(r)] = r
    return list(best.values())


def scale_key(r: Row) -> tuple:
    return (r.device, r.get("workload"), r.get("geometry", ""), r.get("prompts"), r.get("mode"), r.setting)


def scale_order(r: Row) -> tuple:
    workload = r.get("workload", "")
    rank = WORKLOAD_ORDER.index(workload) if workload in WORKLOAD_ORDER else len(WORKLOAD_ORDER)
    mode = MODES.index(r.get("mode")) if r.get("mode") in MODES else len(MODES)
    return (r.device, rank, workload, r.get("geometry", ""), r.get("prompts", 0), r.setting, mode)


def step_rows(rows: list[Row], topics=("scale",)) -> list[Row]:
    """The rows of whole steps the tables show: newest per key, in the order of the tables."""
    steps = [r for r in rows if r.topic in topics and r.get("mode") in MODES]
    return sorted(newest(steps, scale_key), key=scale_order)


def vs_serial(row: Row, rows: list[Row]) -> str:
    """Serial's step time over the row's, from the same run or the same day and device; '' where neither ran."""
    if row.get("mode") == "serial":
        return ""
    same = [r for r in rows if r.topic == row.topic and r.get("ok") and r.get("mode") == "serial"
            and r.device == row.device and r.setting in ("", row.setting)
            and (r.get("workload"), r.get("geometry", ""), r.get("prompts")) ==
            (row.get("workload"), row.get("geometry", ""), row.get("prompts"))]
    for label, match in (("same run", lambda r: r.file == row.file),
                         ("same day", lambda r: r.date[:10] == row.date[:10])):
        found = sorted((r for r in same if match(r)), key=lambda r: (r.date, r.file.name, r.index))
        if found:
            return f"{found[-1].get('step_s') / row.get('step_s'):.2f}x ({label})"
    return ""


def harness(r: Row) -> str:
    """Rows of the run_train.sh harness carry the recipe they ran (`config`); the earlier one built its own step."""
    return "run_train.sh" if "config" in r.data else "earlier harness"


def link(r: Row, page_dir: Path) -> str:
    return f"[{r.file.name}]({Path(os.path.relpath(r.file, page_dir)).as_posix()})"


def cell(value) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def markdown(header: list[str], lines: list[list], empty: str) -> str:
    if not lines:
        return empty
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(cell(v) for v in line) + " |" for line in lines]
    return "\n".join(out)


def num(value, fmt: str, missing: str = "—") -> str:
    return format(value, fmt) if isinstance(value, (int, float)) and value else missing


def what(r: Row) -> list:
    """The columns that say which step a row is."""
    return [r.get("workload"), r.get("geometry", ""), r.get("prompts"), r.get("mode"), r.setting or "default"]


def speed_table(rows: list[Row], page_dir: Path) -> str:
    scale = [r for r in rows if r.topic == "scale"]
    lines = []
    for r in step_rows(rows):
        per_sample = r.get("s_per_sample") or r.get("step_s") / max(r.get("samples") or 1, 1)
        lines.append([*what(r), num(r.get("step_s"), ".2f"), num(per_sample, ".3f"), num(timed_peak(r), ".1f"),
                      vs_serial(r, scale) or "—", r.date[:10], harness(r), r.device, link(r, page_dir)])
    return markdown(["workload", "geometry", "P", "mode", "setting", "step (s)", "s / sample", "timed peak GiB",
                     "vs serial", "date", "run by", "device", "results"], lines, "No scale results yet.")


def timed_peak(r: Row) -> float:
    """The timed steps' peak allocated GiB (the earlier harness's `peak_gib` also counts its warm-up steps)."""
    return r.get("peak_timed_gib") or r.get("peak_gib")


def stage_gib(r: Row) -> dict[str, float]:
    """Peak allocated GiB per stage of the timed step, where the row recorded it."""
    if isinstance(r.get("stage_peak_gib"), dict):
        return r.get("stage_peak_gib")
    measured = (r.get("memory") or {}).get("measured") or {}
    return {stage: b / GiB for stage, b in (measured.get("stage_peak_bytes") or {}).items()}


def memory_table(rows: list[Row], page_dir: Path) -> str:
    picked = [r for r in step_rows(rows) if stage_gib(r)]
    stages = list(dict.fromkeys(s for r in picked for s in stage_gib(r)))
    lines = []
    for r in picked:
        capacity = ((r.get("memory") or {}).get("planned") or {}).get("capacity_bytes", 0) / GiB
        lines.append([*what(r), *(num(stage_gib(r).get(s), ".1f") for s in stages), num(timed_peak(r), ".1f"),
                      num(r.get("peak_gib"), ".1f"), num(capacity, ".1f"), r.date[:10], link(r, page_dir)])
    return markdown(["workload", "geometry", "P", "mode", "setting", *(f"{s} GiB" for s in stages),
                     "timed step GiB", "any step GiB", "capacity GiB", "date", "results"], lines,
                    "No results with per-stage peaks yet.")


def mfu_table(rows: list[Row], page_dir: Path) -> str:
    picked = [r for r in step_rows(rows, topics=("scale", "mfu")) if r.get("mfu")]
    phases = list(dict.fromkeys(p for r in picked for p in r.get("mfu")))
    lines = [[*what(r), *(num(100 * (r.get("mfu").get(p) or 0), ".1f") for p in phases),
              num(r.get("peak_tflops"), ".0f"), r.date[:10], link(r, page_dir)] for r in picked]
    return markdown(["workload", "geometry", "P", "mode", "setting", *(f"{p} MFU %" for p in phases),
                     "matmul peak TFLOP/s", "date", "results"], lines, "No results with MFU yet.")


def decode_key(r: Row) -> tuple:
    return (r.device, r.get("geometry"), r.get("prompts"), r.get("group"), r.get("mode"),
            r.get("rows", r.get("batch")), r.setting)


def decode_table(rows: list[Row], page_dir: Path) -> str:
    decode = [r for r in rows if r.topic == "decode"]
    picked = sorted(newest(decode, decode_key), key=lambda r: tuple(str(v) for v in decode_key(r)))
    lines = []
    for r in picked:
        step_ms = r.get("step_ms") or 1e3 * (r.get("step_s") or 0)
        fraction = r.get("floor_fraction", r.get("fraction_of_floor"))
        lines.append([r.get("geometry"), f"{r.get('prompts')} x {r.get('group')}", r.get("rows", r.get("batch")),
                      r.get("mode"), num(step_ms, ".2f"), num(r.get("floor_ms"), ".2f"),
                      num(100 * (fraction or 0), ".1f"), r.date[:10], r.device, link(r, page_dir)])
    return markdown(["geometry", "prompts x samples in the pool", "rows decoded", "mode", "step (ms)", "floor (ms)",
                     "% of floor", "date", "device", "results"], lines, "No decode results yet.")


def ceiling_table(rows: list[Row], page_dir: Path) -> str:
    files = sorted({r.file for r in rows if r.topic == "scale"})
    lines = []
    for c in ceilings([str(f) for f in files]):
        r = next(r for r in rows if r.file.name == c.file)
        lines.append([c.workload, c.prompts, num(c.decomposed_s, ".2f"), num(c.actor_prefix_forward_s, ".2f"),
                      num(c.ref_prefix_s, ".2f"), f"{c.ceiling:.3f}x", num(c.measured, ".3f") + "x" * bool(c.measured),
                      r.date[:10], link(r, page_dir)])
    return markdown(["workload", "P", "decomposed step (s)", "actor prefix forward (s)", "reference prefix (s, est.)",
                     "ceiling", "measured", "date", "results"], lines,
                    "No scale results with decomposed's training spans yet.")


def recipes_table(rows: list[Row], page_dir: Path) -> str:
    """The newest row per recipe and compile setting, a failed one too (with its error)."""
    recipes = [r for r in rows if r.topic == "recipes"]
    key = lambda r: (r.device, str(r.get("recipe")), str(r.get("compile")))
    lines = []
    for r in sorted(newest(recipes, key, ok_only=False), key=key):
        result = "ok" if r.get("ok") else f"failed: {str(r.get('error'))[:120]}"
        lines.append([r.get("recipe"), r.get("mode", ""), r.get("compile"), num(r.get("step_s"), ".2f"),
                      num(r.get("first_step_s"), ".1f"), num(r.get("peak_gib"), ".1f"), result, r.date[:10], r.device,
                      link(r, page_dir)])
    return markdown(["recipe", "mode", "compile", "step (s)", "first step (s)", "peak GiB", "result", "date", "device",
                     "results"], lines, "No results of topic `recipes` yet (`benchmarks/recipes_gpu.sh` writes them).")


def sglang_table(rows: list[Row], page_dir: Path) -> str:
    sglang = [r for r in rows if r.topic == "sglang"]
    key = lambda r: (r.device, r.get("suite", ""), r.get("workload", ""), r.get("geometry", ""),
                     str(r.get("prompts", "")), r.get("backend", ""), str(r.get("mps", "")))
    lines = []
    for r in sorted(newest(sglang, key), key=key):
        backend = r.get("backend", "") + (" + MPS" if r.get("mps") else "")
        step = r.get("step_s") or r.get("together_s")
        lines.append([r.get("suite", ""), r.get("workload", ""), r.get("geometry", "—"), r.get("prompts", "—"),
                      backend, num(step, ".2f"), num(r.get("logprob_mismatch"), ".4f"), num(r.get("gain"), ".2f"),
                      r.date[:10], r.device, link(r, page_dir)])
    return markdown(["suite", "workload", "geometry", "P", "backend", "step (s)", "log-prob mismatch",
                     "overlap gain", "date", "device", "results"], lines, "No SGLang results yet.")


def render(results: Path, page_dir: Path) -> dict[str, str]:
    """Each table's markdown, by the name of its markers."""
    rows = load(results)
    makers = {"speed": speed_table, "memory": memory_table, "mfu": mfu_table, "decode": decode_table,
              "ceiling": ceiling_table, "recipes": recipes_table, "sglang": sglang_table}
    return {name: makers[name](rows, page_dir) for name in TABLES}


def fill(page: str, tables: dict[str, str]) -> str:
    """The page with each table's text between its markers; every table must have its markers."""
    missing = [n for n in tables if f"<!-- tables:{n}:begin -->" not in page or f"<!-- tables:{n}:end -->" not in page]
    if missing:
        raise ValueError(f"the page has no markers for {missing}: add <!-- tables:NAME:begin --> and "
                         "<!-- tables:NAME:end --> where each table goes")
    for name, text in tables.items():
        pattern = re.compile(rf"(<!-- tables:{name}:begin -->\n).*?(<!-- tables:{name}:end -->)", re.S)
        page = pattern.sub(lambda m: m.group(1) + text + "\n" + m.group(2), page)
    return page


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results", help="results files' folder")
    todo = ap.add_mutually_exclusive_group()
    todo.add_argument("--write", type=Path, metavar="PAGE", help="rewrite the tables in this page")
    todo.add_argument("--check", type=Path, metavar="PAGE", help="exit 1 if this page's tables differ from the files")
    a = ap.parse_args(argv)
    page_path = a.write or a.check
    tables = render(a.results, (page_path or ROOT / "docs" / "performance.md").resolve().parent)
    if page_path is None:
        print("\n\n".join(f"<!-- {name} -->\n{text}" for name, text in tables.items()))
        return 0
    page = page_path.read_text()
    filled = fill(page, tables)
    if a.write:
        page_path.write_text(filled)
        print(f"wrote the tables of {page_path}")
        return 0
    if filled != page:
        print(f"{page_path}: its tables differ from {a.results}; rewrite them with "
              f"python benchmarks/performance_tables.py --write {page_path}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
