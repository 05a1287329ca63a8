"""`simulate fit` and `simulate validate` on the real model at toy sizes: they run end to end and write what the
simulator reads. No speed assertions: only that the fit is finite and non-negative, the JSON loads back through
load_cost_model, and validate's real and simulated runs agree on the cache (same hits) with finite ratios."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math

import pytest

from prefixkv.bench import served_rounds, sim_fit, sim_validate
from prefixkv.bench.session_replay import Calibration
from prefixkv.sim.cost_model import BatchShape, StepCostModel, load_cost_model

TINY_GRID = sim_fit.FitGrid(
    prefills=((0, (8, 32)), (32, (8,))), decode_batches=((32, (2,)),), mixed_chunks=(8,), repeats=1
)


def parse(module, argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    return parser.parse_args(argv)


def test_nonnegative_least_squares_recovers_a_model_and_clips_what_would_go_negative():
    truth = StepCostModel("t", "test", 0.02, 1e-3, 1e-8, 5e-4, per_decode_pair_s=1e-7)
    grid = [(1, 10, 1, 10), (64, 5000, 1, 0), (512, 2e5, 1, 0), (8, 900, 8, 900), (40, 3e4, 4, 300), (9, 2e3, 2, 1e3)]
    shapes = [BatchShape(n, p, s, 0, d) for n, p, s, d in grid]
    rows = [sim_fit.features(s) for s in shapes]
    solved = sim_fit.nonnegative_least_squares(rows, [truth.step_time(s) for s in shapes])
    assert solved == pytest.approx([0.02, 1e-3, 1e-8, 1e-7, 5e-4], rel=1e-6)  # sim_fit.FEATURES' order
    # times that fall with the token count would need a negative per-token cost: clipped to 0, the rest refitted
    rows = [[1.0, 1.0], [1.0, 2.0], [1.0, 3.0]]
    assert sim_fit.nonnegative_least_squares(rows, [3.0, 2.0, 1.0]) == pytest.approx([2.0, 0.0])


def test_fit_on_a_tiny_grid_writes_a_cost_model_the_simulator_loads(new_llm, tmp_path):
    output = tmp_path / "fit" / "model.json"
    args = parse(sim_fit, ["--dtype", "float32", "--kv-cache-tokens", "1024", "--output", str(output)])
    llm = new_llm(kv_cache_tokens=1024, max_num_batched_tokens=64)
    assert sim_fit.run(args, llm_factory=lambda **_: llm, grid=TINY_GRID) == 0

    model = load_cost_model(str(output))
    coefficients = [model.step_overhead_s, model.per_token_s, model.per_attended_pair_s, model.per_sequence_s]
    coefficients.append(model.decode_pair_s)
    assert all(math.isfinite(c) and c >= 0 for c in coefficients) and model.step_overhead_s + model.per_token_s > 0
    assert "float32" in model.source and "threads" in model.source and "grid" in model.source
    record = json.loads(output.read_text())
    labels = [p["label"] for p in record["fit"]["points"]]
    assert labels == [
        "prefill 8 @ 0",
        "prefill 32 @ 0",
        "prefill 8 @ 32",
        "decode 2 x ctx 32",
        "decode 2 x ctx 32 + chunk 8",
    ]  # every shape of the grid was built as planned (a missed prefix hit would drop its point)
    by_label = {p["label"]: p for p in record["fit"]["points"]}
    assert by_label["prefill 8 @ 32"]["attended_pairs"] == 8 * 32 + 8 * 9 // 2  # the chunk after a 32-token hit
    assert by_label["decode 2 x ctx 32 + chunk 8"]["num_decodes"] == 2
    assert all(p["seconds"] > 0 and math.isfinite(p["relative_error"]) for p in record["fit"]["points"])
    assert llm.llm_engine.kv.num_used_pages() == 0  # nothing left running or holding pages


def test_validate_on_a_tiny_trace_gets_the_simulators_hits_and_finite_ratios(new_llm, tmp_path):
    trace = tmp_path / "tiny.jsonl"
    rows = [  # 512-token blocks, 16 tokens each after scaling; A and B share block 0, C extends A, D shares nothing
        (0, 1024, 64, [0, 1]),
        (0, 1024, 64, [0, 2]),
        (0, 1500, 32, [0, 1, 3]),
        (0, 400, 64, [4]),
        (300, 1024, 64, [5, 6]),  # 0.3 s later: the engine waits for it on the wall clock
    ]
    trace.write_text(
        "".join(
            json.dumps({"timestamp": t, "input_length": n, "output_length": o, "hash_ids": ids}) + "\n"
            for t, n, o, ids in rows
        )
    )
    output = tmp_path / "validate.json"
    argv = ["--trace", str(trace), "--cost-model", "smollm2-cpu-2t", "--output", str(output), "--dtype", "float32"]
    args = parse(sim_validate, argv)
    llm = new_llm(kv_cache_tokens=1024)
    assert sim_validate.run(args, llm_factory=lambda **_: llm) == 0

    result = json.loads(output.read_text())
    assert result["requests"] == 5 and result["rejected"] == {"real": 0, "simulated": 0}
    real, simulated = result["hit_rate"]["real"], result["hit_rate"]["simulated"]
    # B and C wait one step for A's first page (computed once), then hit it: 16 + 32 of 32 + 32 + 47 + 12 + 32
    assert real == simulated == {"hit_tokens": 48, "prompt_tokens": 155, "token_hit_rate": 48 / 155}
    assert result["requests_with_different_hits"] == []
    for metric in ("ttft_s", "queue_s"):
        for cell in result["percentiles"][metric].values():
            assert math.isfinite(cell["ratio"]) and cell["real"] > 0
    assert "512->16 tokens/block" in result["scaling"]
    steps = result["real_steps"]  # the cost model checked on the real run's own steps
    assert steps["steps"] >= 3 and steps["measured_s"] > 0 and math.isfinite(steps["ratio"])
    assert llm.llm_engine.kv.num_used_pages() == 0


def test_the_cli_routes_fit_and_validate_with_their_own_output_flag():
    from prefixkv import cli

    parser = argparse.ArgumentParser()
    cli.register_simulate(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["simulate", "fit", "--quick", "--output", "m.json"])
    assert (args.func, args.quick, args.output, args.dtype) == (sim_fit.run, True, "m.json", "bfloat16")
    args = parser.parse_args(["simulate", "validate", "--trace", "t.jsonl", "--cost-model", "m.json", "--output", "v"])
    assert (args.func, args.trace, args.cost_model, args.output) == (sim_validate.run, "t.jsonl", "m.json", "v")


def test_validate_names_a_missing_trace_or_cost_model_before_loading_the_model(tmp_path):
    args = parse(sim_validate, ["--trace", str(tmp_path / "none.jsonl"), "--cost-model", "smollm2-cpu-2t"])
    with pytest.raises(ValueError, match="none.jsonl: no such file"):
        sim_validate.run(args, llm_factory=lambda **_: pytest.fail("the model must not be built"))
    args = parse(sim_validate, ["--trace", str(tmp_path / "none.jsonl"), "--cost-model", str(tmp_path / "m.json")])
    with pytest.raises(ValueError, match="neither a preset"):
        sim_validate.run(args)


def test_a_calibration_scales_the_model_to_the_speed_its_rounds_ran_at():
    """A replay's calibration: rounds "measured" on a machine 1.3x slower than the fit (the median of three
    samples each, one of them spoiled) give the factor 1.3, and the scaled model (served, every coefficient x1.3)
    predicts those rounds exactly; the model as fitted is left as it was."""
    from prefixkv.config import EngineConfig

    config = EngineConfig(kv_cache_tokens=1 << 16)
    fitted = StepCostModel("e", "test", 0.006, 3e-4, 1.2e-7, 1.4e-4, per_decode_pair_s=1.1e-6, serve_per_step_s=1e-3)
    fitted = fitted.served()
    slower = fitted.scaled(1.3, "the machine now")
    assert slower.served() is slower and slower.per_decode_pair_s == pytest.approx(1.43e-6)
    assert slower.source == "test; x1.3000: the machine now"
    shapes = served_rounds.parse_served_shapes("1x1024->32, 4x256->16", "--calibration-shapes")
    assert shapes == [served_rounds.ServedShape(1, 1024, 32), served_rounds.ServedShape(4, 256, 16)]
    rounds = {}
    for shape in shapes:
        r = served_rounds.simulate_round(config, slower, shape)
        spoiled = served_rounds.RoundTimes(r.ttft_s * 3, r.e2e_s * 3)
        rounds[shape] = [r, spoiled, r]
    calibrated, report = Calibration(shapes, rounds, 1.0).apply(config, fitted)
    assert report["factor"] == pytest.approx(1.3)
    assert [row["ratio"] for row in report["shapes"]] == pytest.approx([1.3, 1.3])
    for shape in shapes:
        assert served_rounds.simulate_round(config, calibrated, shape).e2e_s == pytest.approx(rounds[shape][0].e2e_s)
    assert fitted.step_overhead_s == 0.006
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="scale factor must be finite and > 0"):
            fitted.scaled(bad, "x")
    for spec in ("1x64", "1x64->1", "0x64->4", "ax64->4"):
        with pytest.raises(ValueError, match=r"--calibration-shapes: '.*'"):
            served_rounds.parse_served_shapes(spec, "--calibration-shapes")


def test_the_serving_overhead_fit_recovers_a_known_overhead():
    """Rounds "measured" on a simulated server with a known overhead: the fit finds it again, and the step model's
    own coefficients are kept."""
    from prefixkv.config import EngineConfig

    config = EngineConfig(kv_cache_tokens=1 << 16)
    engine = StepCostModel("e", "test", 0.006, 3e-4, 1.2e-7, 1.4e-4, per_decode_pair_s=1.1e-6)
    truth = dataclasses.replace(
        engine, serve_per_request_s=0.002, serve_per_step_s=0.0015, serve_per_output_token_s=3e-4
    )
    shapes = [served_rounds.ServedShape(c, 256, n) for c in (1, 4) for n in (16, 64)]
    measured = {shape: served_rounds.simulate_round(config, truth.served(), shape) for shape in shapes}
    model, report = sim_fit.fit_serve_overhead(config, engine, measured)
    assert model.serve_per_step_s == pytest.approx(0.0015, rel=1e-6)
    assert model.serve_per_output_token_s == pytest.approx(3e-4, rel=1e-6)
    assert model.serve_per_request_s == pytest.approx(0.002, rel=1e-6)
    unserved = {"serve_per_request_s": 0.0, "serve_per_step_s": 0.0, "serve_per_output_token_s": 0.0}
    assert dataclasses.replace(model, **unserved) == engine  # the step terms untouched
    assert all(abs(p["relative_error"]) < 1e-9 and p["engine_only_relative_error"] < 0 for p in report)


def test_serving_overhead_fit_against_a_live_server(new_engine, tmp_path):
    """`simulate fit --serve-url` end to end on tiny rounds: a cost model the simulator loads, its step terms those
    of --cost-model, its serving overhead finite and >= 0, every round recorded."""
    from tests.server.live_server import running_server

    output = tmp_path / "served.json"
    argv = ["--cost-model", "smollm2-cpu-2t", "--output", str(output), "--repeats", "1", "--kv-cache-tokens", "4096"]
    argv += ["--serve-prompt-tokens", "16", "--serve-output-tokens", "2,6", "--serve-concurrency", "1,2"]
    with running_server(new_engine(kv_cache_tokens=4096)) as (base, _, _):
        assert sim_fit.run(parse(sim_fit, ["--serve-url", base, *argv])) == 0
    model = load_cost_model(str(output))
    preset = load_cost_model("smollm2-cpu-2t")
    unserved = {"serve_per_request_s": 0.0, "serve_per_step_s": 0.0, "serve_per_output_token_s": 0.0}
    assert dataclasses.replace(model, source=preset.source, **unserved) == preset
    serve = [model.serve_per_request_s, model.serve_per_step_s, model.serve_per_output_token_s]
    assert all(math.isfinite(v) and v >= 0 for v in serve)
    record = json.loads(output.read_text())
    labels = [p["label"] for p in record["fit"]["serving"]["points"]]
    assert labels == ["1 x (16 -> 2)", "1 x (16 -> 6)", "2 x (16 -> 2)", "2 x (16 -> 6)"]
    assert "serving overhead" in model.source


def test_the_kept_repeat_is_the_fastest_or_the_median_one():
    samples = [("a", 3.0), ("b", 1.0), ("c", 2.0), ("d", 9.0)]
    assert sim_fit.pick(samples, "min", key=lambda s: s[1]) == ("b", 1.0)
    assert sim_fit.pick(samples, "median", key=lambda s: s[1]) == ("a", 3.0)  # the upper of the two middle ones
    assert sim_fit.pick(samples[:3], "median", key=lambda s: s[1]) == ("c", 2.0)
    with pytest.raises(ValueError, match="statistic"):
        sim_fit.pick(samples, "mean", key=lambda s: s[1])
