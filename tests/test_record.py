"""Run records carry the six conditions and are written atomically."""
import json

import pytest

from evals.record import (ArrivalProcess, EngineCondition, LengthDistribution, MetricCondition, ModelCondition,
                          RunRecord, hardware_info, write_json_atomic)
from evals.roofline import decode_bytes_per_token
from runtime.loading import load_model


def make_record():
    return RunRecord(
        name="t", model=ModelCondition("m", "abc", "fp32"), hardware=hardware_info(),
        lengths=LengthDistribution(2, {"mean": 5}, {"fixed": 8}, "synthetic", True),
        arrival=ArrivalProcess(), engine=EngineCondition("native"),
        metric=MetricCondition({"tok_s": "tokens/s"}, "greedy"), results={"tok_s": 1.5})


def test_record_round_trip(tmp_path):
    rec = make_record()
    path = rec.write(tmp_path / "sub" / "r.json")
    data = json.loads(path.read_text())
    for key in ("model", "hardware", "lengths", "arrival", "engine", "metric"):
        assert key in data
    assert data["hardware"]["cores"] >= 1 and data["hardware"]["libraries"]["torch"].startswith("torch==")
    assert RunRecord.from_dict(data) == rec


def test_atomic_write_leaves_old_file_on_failure(tmp_path):
    path = tmp_path / "r.json"
    write_json_atomic(path, {"a": 1})
    with pytest.raises(TypeError):
        write_json_atomic(path, {"a": object.__new__(type("Unserialisable", (), {"__str__": None}))})
    assert json.loads(path.read_text()) == {"a": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]


def test_decode_bytes_counts_weights_not_cache(tiny_llama_dir):
    lm = load_model(str(tiny_llama_dir))
    lm.model.setup_cache(1, 64)
    cfg = lm.model.args
    expected_params = sum(p.numel() for p in lm.model.parameters()) - cfg.vocab_size * cfg.dim  # untied: no embed
    assert decode_bytes_per_token(lm.model) == 4 * expected_params


def test_q4_1_caveat_is_printed_only_beside_4_bit_results():
    """Every default-model record keeps the Q4_1 note; commands print it only where 4-bit weights ran (negative
    control: the note's own text names int4-g32-asym, which must not count)."""
    from runtime.model_store import SMOLLM2, caveat_applies

    def record(scheme, spec=None, note=SMOLLM2.note):
        return {"model": {"note": note, "scheme": scheme}, "engine": {"config": {"spec": spec}}}

    assert not caveat_applies(record("w8ch-sym")) and not caveat_applies(record(None))
    assert caveat_applies(record("w4g32-asym")) and caveat_applies(record("W4A16"))
    assert caveat_applies(record(None, spec="selfquant:w4g32-sym"))
    assert not caveat_applies(record("w4g32-asym", note=""))  # another model: no note to print
