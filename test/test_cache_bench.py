"""``vla-accel bench cache`` on a tiny bundle: it runs, and reports what the note quotes."""

from __future__ import annotations

import json

import pytest

from vla_accel_ros.cli import main
from vla_accel_ros.core.errors import ConfigError


def test_bench_cache_reports_latency_reuse_and_deviation(tiny_bundles, tmp_path, capsys):
    out = tmp_path / "cache.json"
    code = main([
        "bench", "cache", "--bundle", str(tiny_bundles["ar"]), "--frames", "3", "--warmup", "1",
        "--presets", "default,max-reuse", "--cache", "max_reuse_age=4", "--json", str(out),
    ])  # fmt: skip
    assert code == 0
    text = capsys.readouterr().out
    assert "speedup" in text and "per-stage p50 ms" in text and "tokens identical" in text
    result = json.loads(out.read_text())
    rows = {r["name"]: r for r in result["rows"]}
    assert set(rows) == {"full", "default", "max-reuse"}
    m = rows["max-reuse"]
    assert m["cache"]["max_reuse_age"] == 4 and m["cache"]["relevance_mode"] == "off"
    assert 0.0 < m["reuse_fraction_mean"] <= 0.5  # 4 layers, the first 2 recompute everything
    assert m["select_ms"]["p50"] > 0.0 and m["stages_p50_ms"]["total"] > 0.0
    assert 0.0 <= m["deviation"]["identical_token_share"] <= 1.0
    assert m["deviation"]["kv_rel_err_text_max"] >= 0.0 and rows["default"]["deviation"]["kv_rel_err_image_max"] >= 0.0
    assert m["resets"] == 0  # the warm-up frame absorbed the first full recompute


def test_bench_cache_flow_reports_deviation_in_std(tiny_bundles, tmp_path):
    from vla_accel_ros.bench.cache_bench import run_cache_bench

    result = run_cache_bench(tiny_bundles["flow"], presets=("max-reuse",), frames=2, warmup=1)
    row = result["rows"][1]
    assert row["deviation"]["max_delta_over_std"] >= 0.0 and "identical_token_share" not in row["deviation"]
    assert row["reuse_fraction_mean"] > 0.0


def test_bench_cache_rejects_bad_overrides(tiny_bundles, capsys):
    from vla_accel_ros.cli.options import parse_overrides

    assert parse_overrides(["sim_threshold=0.9", "reuse_layers=[2,3]", "layer_schedule=entropy"]) == {
        "sim_threshold": 0.9, "reuse_layers": [2, 3], "layer_schedule": "entropy",
    }  # fmt: skip
    with pytest.raises(ConfigError):
        parse_overrides(["sim_threshold"])
    code = main(["bench", "cache", "--bundle", str(tiny_bundles["ar"]), "--frames", "1", "--cache", "sim_threshold=2"])
    assert code == 2 and "CacheConfig.sim_threshold=2" in capsys.readouterr().err
    code = main(["bench", "cache", "--bundle", str(tiny_bundles["ar"]), "--frames", "1", "--presets", "fastest"])
    assert code == 2 and "cache preset 'fastest'" in capsys.readouterr().err
