"""benchmarks/mode_ceiling.py: the bound on overlapped / decomposed from a run's decomposed spans and FLOPs."""

import json

import pytest

from benchmarks.mode_ceiling import ceilings, table


def row(mode, step_s, ok=True, **extra):
    return {"workload": "img", "geometry": "7B", "prompts": 32, "group": 8, "mode": mode, "step_s": step_s,
            "phases_s": {"rollout": 8.0, "ref": 4.0, "train": step_s - 12.0}, "ok": ok, "error": "", **extra}


DECOMPOSED = row("decomposed", 20.0, train_spans={"totals": {"prefix_forward": {"count": 1, "device_s": 2.0}}},
                 pflop={"prefill": 1.0, "reference": 4.0, "train": 9.0}, response_tokens=1000)


def write(tmp_path, name, rows):
    path = tmp_path / name
    path.write_text(json.dumps({"topic": "scale", "rows": rows}))
    return str(path)


def test_the_floor_removes_the_measured_actor_prefix_and_the_reference_prefix_flop_share(tmp_path):
    f = write(tmp_path, "scale-a.json", [DECOMPOSED, row("overlapped", 18.0, response_tokens=950)])
    (c,) = ceilings([f])
    # the reference phase (4 s) times prefill / reference FLOPs (1 / 4): 1 s; the actor's prefix forward: 2 s
    assert c.ref_prefix_s == pytest.approx(1.0)
    assert c.floor_s == pytest.approx(17.0)
    assert c.ceiling == pytest.approx(20.0 / 17.0)
    assert c.measured == pytest.approx(20.0 / 18.0)
    assert c.response_tokens == (950, 1000)
    assert c.removed_for(1.25) == pytest.approx(4.0)  # 20 s down to 16 s
    assert "| 1.176x | 1.111x | 950 / 1000 |" in table([c])


def test_modes_pair_within_one_run_and_failed_or_unspanned_rows_give_none(tmp_path):
    alone = write(tmp_path, "scale-a.json", [DECOMPOSED, row("overlapped", 0.0, ok=False)])
    other = write(tmp_path, "scale-b.json", [row("overlapped", 15.0)])
    unspanned = write(tmp_path, "scale-c.json", [row("decomposed", 20.0), row("overlapped", 18.0)])
    rows = ceilings([alone, other, unspanned])
    assert [(c.file, c.overlapped_s) for c in rows] == [("scale-a.json", None)]  # not paired with scale-b's
    assert "| - | - |" in table(rows)


def test_the_plot_is_written(tmp_path):
    from benchmarks.mode_ceiling import plot

    f = write(tmp_path, "scale-a.json", [DECOMPOSED, row("overlapped", 18.0)])
    out = tmp_path / "ceiling.png"
    plot(ceilings([f]), str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
