from tests.support.simproc import SimProcess


def test_llama_stream_ends_with_stop_event(fast_sim: SimProcess) -> None:
    s = fast_sim.stream(
        "/completion",
        {"prompt": "once upon a time", "n_predict": 8, "stream": True, "ignore_eos": True},
        headers={"X-Request-Id": "smoke-1"},
    )
    assert s.status == 200
    assert s.headers["x-request-id"] == "smoke-1"
    events = s.json_events()
    assert events[-1]["stop"] is True
    assert events[-1]["tokens_predicted"] == 8
    assert b"[DONE]" not in s.raw
