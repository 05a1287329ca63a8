"""The simulator's clock: batch features, the linear step time, presets and the JSON files `simulate fit` writes."""

from __future__ import annotations

import json

import pytest

from prefixkv.request import Request
from prefixkv.sampling_params import SamplingParams
from prefixkv.sim.cost_model import PRESETS, BatchShape, StepCostModel, load_cost_model


def _request(prompt_len: int, computed: int, outputs: int = 0) -> Request:
    req = Request("r", list(range(prompt_len)), SamplingParams())
    req.token_ids.extend(range(1000, 1000 + outputs))
    req.num_computed_tokens = computed
    return req


def test_batch_shape_counts_tokens_pairs_and_decodes():
    prefill = _request(10, 4)  # a chunk of 6 tokens from position 4: 6*4 + 21 pairs
    decode = _request(3, 3, outputs=1)  # one token at position 3 after its prompt: 3 + 1 pairs
    last_prompt_token = _request(5, 4)  # one token, but still the prompt: not a decode
    shape = BatchShape.of([(prefill, 6), (decode, 1), (last_prompt_token, 1)])
    # all three sample a token: the chunk and the last prompt token end their prompts
    assert shape == BatchShape(8, attended_pairs=45 + 4 + 5, num_sequences=3, num_decodes=1, decode_pairs=4, sampled=3)
    assert BatchShape.of([(_request(10, 2), 6)]).sampled == 0  # a chunk short of its prompt's end outputs nothing
    assert shape.prefill_pairs == 50
    assert BatchShape.of([]) == BatchShape(0, 0, 0, 0)


def test_step_time_is_linear_in_the_five_features():
    model = StepCostModel(
        "m", "test", step_overhead_s=1.0, per_token_s=0.1, per_attended_pair_s=0.01, per_sequence_s=0.5
    )
    assert model.step_time(BatchShape(10, 100, 2, 1)) == pytest.approx(1.0 + 1.0 + 1.0 + 1.0)
    # without a decode rate of their own, decode pairs cost what prefill pairs do (models written before it)
    assert model.step_time(BatchShape(10, 100, 2, 1, decode_pairs=40)) == pytest.approx(4.0)
    decode_aware = StepCostModel("m", "test", 1.0, 0.1, 0.01, 0.5, per_decode_pair_s=0.1)
    assert decode_aware.step_time(BatchShape(10, 100, 2, 1, decode_pairs=40)) == pytest.approx(3.0 + 0.6 + 4.0)
    assert StepCostModel.from_json(decode_aware.to_json()) == decode_aware
    with pytest.raises(ValueError, match="per_decode_pair_s"):
        StepCostModel("m", "test", 1.0, 0.1, 0.01, 0.5, per_decode_pair_s=-1.0)


def test_json_round_trip_and_presets_state_their_source(tmp_path):
    for model in PRESETS.values():
        assert model.source and model.step_overhead_s > 0 and model.per_token_s > 0
        assert StepCostModel.from_json(json.loads(json.dumps(model.to_json()))) == model
    assert {"smollm2-cpu-2t", "llama3-8b-h100", "llama3-70b-h100x4"} <= set(PRESETS)
    h100 = PRESETS["llama3-8b-h100"]
    assert h100.step_overhead_s == pytest.approx(8.03e9 * 2 / 3.35e12)  # weights streamed once per step
    path = tmp_path / "fit.json"
    path.write_text(json.dumps(h100.to_json() | {"name": "mine"}))
    assert load_cost_model(str(path)).name == "mine"
    assert load_cost_model("llama3-8b-h100") is h100


@pytest.mark.parametrize(
    "content, message",
    [
        ("{not json", "cannot read it as JSON"),
        ("[1, 2]", "must be a JSON object"),
        ('{"name": "x", "source": "y", "step_overhead_s": 0.1, "per_token_s": 0.1}', "missing field(s) per_attended"),
        (
            '{"name": "x", "source": "y", "step_overhead_s": 0.1, "per_token_s": 0.1, "per_attended_pair_s": 0, '
            '"per_step": 1}',
            "unknown field(s) per_step",
        ),
        (
            '{"name": "x", "source": "y", "step_overhead_s": -1, "per_token_s": 0.1, "per_attended_pair_s": 0}',
            "step_overhead_s must be a finite number >= 0",
        ),
        (
            '{"name": "x", "source": "y", "step_overhead_s": "1", "per_token_s": 0.1, "per_attended_pair_s": 0}',
            "step_overhead_s must be a finite number >= 0",
        ),
    ],
)
def test_a_bad_cost_model_file_gets_a_clear_error(tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ValueError, match="bad.json") as info:
        load_cost_model(str(path))
    assert message in str(info.value)


def test_an_unknown_name_lists_the_presets():
    with pytest.raises(ValueError, match="neither a preset .*smollm2-cpu-2t.* nor an existing JSON file"):
        load_cost_model("no-such-model")


def test_serving_overhead_is_charged_only_by_the_served_model():
    """served() adds serve_per_step_s and serve_per_output_token_s per output to a step that outputs, and delays
    each request by serve_per_request_s; the model itself (the engine alone, as `simulate` runs it) charges none."""
    model = StepCostModel(
        "m", "test", 1.0, 0.1, 0.01, 0.5, serve_per_request_s=0.3, serve_per_step_s=0.2, serve_per_output_token_s=0.05
    )
    shape = BatchShape(10, 100, 2, 1, sampled=2)
    assert model.step_time(shape) == pytest.approx(4.0) and model.request_overhead_s() == 0.0
    served = model.served()
    assert served.step_time(shape) == pytest.approx(4.0 + 0.2 + 2 * 0.05)
    assert served.step_time(BatchShape(10, 100, 2, 0, sampled=0)) == pytest.approx(4.0)  # no outputs, no delivery
    assert served.request_overhead_s() == pytest.approx(0.3)
    assert served.engine_only() == model and served.served() is served
    assert StepCostModel.from_json(served.to_json()) == model  # the file keeps the coefficients, not the mode
    plain = StepCostModel("m", "test", 1.0, 0.1, 0.01)
    assert plain.served() is plain and not plain.has_serve_overhead


def test_files_written_before_the_serving_overhead_load_with_none(tmp_path):
    old = {k: v for k, v in PRESETS["smollm2-cpu-2t"].to_json().items() if not k.startswith("serve_")}
    path = tmp_path / "old.json"
    path.write_text(json.dumps({**old, "fit": {"points": []}}))
    model = load_cost_model(str(path))
    assert (model.serve_per_request_s, model.serve_per_step_s, model.serve_per_output_token_s) == (0.0, 0.0, 0.0)
    assert all(not m.has_serve_overhead for m in PRESETS.values())
    with pytest.raises(ValueError, match="serve_per_step_s"):
        StepCostModel("m", "test", 1.0, 0.1, 0.01, serve_per_step_s=-1.0)
