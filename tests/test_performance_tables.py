"""benchmarks/performance_tables.py: docs/performance.md's tables from results files (../shared/RESULTS.md) — the
newest ok row per device, workload, geometry, P, mode and setting; ratios to serial only from the same run or the
same day and device; a link to its file on every row; --write fills the page between its markers, --check fails when
the page and the files disagree."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import performance_tables as pt

REPO = Path(__file__).resolve().parents[1]
GiB = 2**30


def step(P, mode, step_s, ok=True, **extra):
    return {"workload": "img", "geometry": "7B", "prompts": P, "group": 8, "mode": mode, "step_s": step_s,
            "phases_s": {}, "peak_gib": 100.0, "samples": 8 * P, "tokens": 1000, "ok": ok,
            "error": "" if ok else "OutOfMemoryError: in the train stage", **extra}


def write(folder: Path, name: str, rows: list, date: str, topic="scale", device="GPU-X",
          command="python benchmarks/scale_bench.py --workload img", **header):
    doc = {"topic": topic, "command": command, "device": device, "gpus": 1, "torch": "2.13.0", "date": date,
           "rows": rows, **header}
    (folder / name).write_text(json.dumps(doc))


@pytest.fixture
def results(tmp_path):
    folder = tmp_path / "benchmarks" / "results"
    folder.mkdir(parents=True)
    (tmp_path / "docs").mkdir()  # where the page goes
    memory = {"measured": {"stage_peak_bytes": {"rollout": 60 * GiB, "ref": 50 * GiB, "train": 90 * GiB}},
              "planned": {"capacity_bytes": 139 * GiB}}
    spans = {"totals": {"prefix_forward": {"device_s": 1.0}}}
    write(folder, "scale-20260101-a.json", [
        step(8, "serial", 30.0),
        step(8, "decomposed", 12.0, phases_s={"ref": 2.0}, train_spans=spans, pflop={"prefill": 0.5, "reference": 1.0},
             memory=memory, mfu={"prefill": 0.5, "reference": 0.6, "train": 0.45}, peak_tflops=750.0),
        step(8, "overlapped", 10.0)], "2026-01-01T10:00Z")
    write(folder, "scale-20260102-b.json", [step(8, "overlapped", 9.0, peak_gib=130.0, peak_timed_gib=120.0),
                                            step(8, "decomposed", 0.0, ok=False)],
          "2026-01-02T09:00Z")
    write(folder, "scale-20260102-c.json", [step(32, "serial", 40.0)], "2026-01-02T10:00Z")
    write(folder, "scale-20260102-d.json", [step(32, "overlapped", 20.0)], "2026-01-02T11:00Z")
    write(folder, "scale-20260102-e.json", [step(32, "decomposed", 21.0)], "2026-01-02T12:00Z", device="GPU-Y")
    write(folder, "scale-20260103-compact.json", [step(8, "overlapped", 8.0)], "2026-01-03T10:00Z",
          command="python benchmarks/scale_bench.py --workload img --compact-decode")
    write(folder, "decode-20260101-b64.json", [
        {"workload": "decode", "geometry": "7B", "prompts": 64, "group": 1, "mode": "compiled", "batch": 64,
         "step_s": 0.0066, "step_ms": 6.6, "floor_ms": 5.28, "floor_fraction": 0.8, "ok": True, "error": ""}],
          "2026-01-01T11:00Z", topic="decode")
    write(folder, "recipes-20260104.json", [
        {"recipe": "qwen2_5_vl_7b", "mode": "decomposed", "compile": True, "step_s": 30.0, "first_step_s": 95.0,
         "peak_gib": 110.0,
         "ok": True, "error": ""},
        {"recipe": "clevr_count_7b", "mode": "decomposed", "compile": True, "ok": False,
         "error": "run A exit 1: ValueError: data.train_files | missing"}], "2026-01-04T10:00Z", topic="recipes")
    (folder / "notes.json").write_text(json.dumps({"not": "a results file"}))
    return folder


def rows_of(table: str) -> list[dict]:
    """A markdown table's body rows as dicts by column name."""
    lines = [line for line in table.splitlines() if line.startswith("|")]
    if not lines:
        return []
    split = lambda line: [c.strip() for c in line.strip("|").split(" | ")]
    header = split(lines[0])
    return [dict(zip(header, split(line))) for line in lines[2:]]


def tables(results: Path) -> dict[str, list[dict]]:
    page_dir = results.parents[1] / "docs"
    return {name: rows_of(text) for name, text in pt.render(results, page_dir).items()}


def find(rows, **want) -> list[dict]:
    return [r for r in rows if all(r[k] == v for k, v in want.items())]


def test_the_newest_ok_row_of_a_workload_P_and_mode_wins_and_a_failed_run_replaces_nothing(results):
    speed = tables(results)["speed"]
    [overlapped] = find(speed, P="8", mode="overlapped", setting="default")
    assert overlapped["step (s)"] == "9.00" and "scale-20260102-b.json" in overlapped["results"]
    assert overlapped["timed peak GiB"] == "120.0"  # not its warm-up's 130.0
    [decomposed] = find(speed, P="8", mode="decomposed")
    assert decomposed["step (s)"] == "12.00" and "scale-20260101-a.json" in decomposed["results"]
    assert decomposed["s / sample"] == "0.188"


def test_an_experiment_flag_gets_its_own_row_beside_the_default(results):
    speed = tables(results)["speed"]
    [compact] = find(speed, P="8", mode="overlapped", setting="compact decode")
    assert compact["step (s)"] == "8.00"
    assert find(speed, P="8", mode="overlapped", setting="default")[0]["step (s)"] == "9.00"


def test_a_ratio_to_serial_comes_only_from_the_same_run_or_the_same_day_and_device(results):
    speed = tables(results)["speed"]
    assert find(speed, P="8", mode="decomposed")[0]["vs serial"] == "2.50x (same run)"
    assert find(speed, P="8", mode="overlapped", setting="default")[0]["vs serial"] == "—"  # serial a day earlier
    assert find(speed, P="32", mode="overlapped")[0]["vs serial"] == "2.00x (same day)"  # another file, same day
    [other_device] = find(speed, P="32", mode="decomposed")
    assert other_device["vs serial"] == "—" and other_device["device"] == "GPU-Y"
    assert find(speed, P="8", mode="serial")[0]["vs serial"] == "—"


def test_every_row_links_its_results_file_relative_to_the_page(results):
    page_dir = results.parents[1] / "docs"
    for name, rows in tables(results).items():
        for row in rows:
            target = row["results"].split("](")[1].rstrip(")")
            assert target.startswith("../benchmarks/results/"), (name, target)
            assert (page_dir / target).is_file(), (name, target)


def test_memory_mfu_and_ceiling_tables_read_the_rows_stage_peaks_mfu_and_spans(results):
    t = tables(results)
    [memory] = t["memory"]  # the one row with per-stage peaks
    assert (memory["rollout GiB"], memory["ref GiB"], memory["train GiB"], memory["capacity GiB"]) == \
        ("60.0", "50.0", "90.0", "139.0")
    [mfu] = t["mfu"]
    assert (mfu["prefill MFU %"], mfu["reference MFU %"], mfu["train MFU %"]) == ("50.0", "60.0", "45.0")
    # decomposed 12 s less 1 s of actor prefix forward and 2 s x 0.5/1.0 of reference prefix: a 10 s floor
    [ceiling] = t["ceiling"]
    assert (ceiling["ceiling"], ceiling["measured"]) == ("1.200x", "1.200x")


def test_decode_and_recipes_tables_show_the_floor_and_failed_recipes_with_their_error(results):
    t = tables(results)
    [decode] = t["decode"]
    assert (decode["step (ms)"], decode["floor (ms)"], decode["% of floor"]) == ("6.60", "5.28", "80.0")
    by_recipe = {r["recipe"]: r for r in t["recipes"]}
    assert by_recipe["qwen2_5_vl_7b"]["result"] == "ok" and by_recipe["qwen2_5_vl_7b"]["step (s)"] == "30.00"
    assert by_recipe["qwen2_5_vl_7b"]["first step (s)"] == "95.0"  # what a user waits for the compilation
    assert by_recipe["clevr_count_7b"]["result"].startswith("failed: run A exit 1: ValueError")
    assert t["sglang"] == []


def test_write_fills_every_table_between_its_markers_and_check_fails_until_the_page_matches(results, capsys):
    page = results.parents[1] / "docs" / "performance.md"
    page.write_text("# Performance\n\nProse the script leaves alone.\n\n" + "".join(
        f"<!-- tables:{name}:begin -->\nstale\n<!-- tables:{name}:end -->\n\n" for name in pt.TABLES))
    argv = ["--results", str(results)]
    assert pt.main([*argv, "--check", str(page)]) == 1
    assert "--write" in capsys.readouterr().out
    assert pt.main([*argv, "--write", str(page)]) == 0
    text = page.read_text()
    assert "stale" not in text and text.count("Prose the script leaves alone.") == 1
    assert "| img | 7B | 8 | overlapped | default | 9.00 |" in text
    assert pt.main([*argv, "--check", str(page)]) == 0
    write(results, "scale-20260105-f.json", [step(8, "overlapped", 7.5)], "2026-01-05T10:00Z")
    assert pt.main([*argv, "--check", str(page)]) == 1  # a new results file: the page is out of date


def test_a_page_without_a_tables_markers_is_refused_naming_the_table(results):
    with pytest.raises(ValueError, match="decode"):
        pt.fill("<!-- tables:speed:begin -->\n<!-- tables:speed:end -->\n", {"speed": "x", "decode": "y"})


def test_the_committed_performance_page_is_what_the_committed_results_give():
    assert pt.main(["--check", str(REPO / "docs" / "performance.md")]) == 0
