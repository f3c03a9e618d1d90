"""The GEMV benches' coordinate-descent sweep (bench/engine_gemv_chain.py), on a made-up cost."""

from __future__ import annotations

from bench.engine_gemv_chain import sweep

COST = {"a": {1: 3.0, 2: 1.0, 3: 2.0}, "b": {1: 2.0, 2: 5.0, 3: 0.5}}


def _time(configs: dict[str, int]) -> float:
    if configs == {"a": 3, "b": 1}:
        raise RuntimeError("rejected")  # as a compiler refusing a launch configuration
    return COST["a"][configs["a"]] + COST["b"][configs["b"]]


def test_each_key_takes_its_fastest_candidate_with_the_others_held() -> None:
    def fits(name: str, config: int) -> bool:
        return not (name == "b" and config == 2)

    result = sweep(_time, {"a": 1, "b": 1}, [1, 2, 3], floor_ms=1.0, fits=fits)
    default = {"configs": {"a": 1, "b": 1}, "chain_ms": 5.0, "fraction_of_floor": 0.2}
    assert result["default"] == default
    assert result["best"]["configs"] == {"a": 2, "b": 3} and result["best"]["chain_ms"] == 1.5
    assert result["tried_ms"]["a"]["3"].startswith("RuntimeError")  # recorded, not fatal
    assert "2" not in result["tried_ms"]["b"]  # what does not fit is never timed
