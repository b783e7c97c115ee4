"""Exact-length prompts, sized by the real simulator's /tokenize; no prompt text recorded."""

from __future__ import annotations

from pathlib import Path

import pytest

from calculet_load.measure.io_engines import run_in_greenlet
from calculet_load.measure.prompts import (
    MIN_ALPHABET,
    Nonce,
    PromptFactory,
    WorkloadError,
    http_tokenizer,
    nonce_salt,
    sample_words,
)
from calculet_load.measure.session import RequestSpec, RunContext, Session
from calculet_load.measure.sink import PartSink
from calculet_load.schema.runfolder import part_files
from tests.support.simproc import SimProcess


def test_corpus_samples_are_deterministic_and_distinct() -> None:
    assert sample_words(0, 1, 50) == sample_words(0, 1, 50)
    assert sample_words(0, 1, 50) != sample_words(0, 2, 50)
    assert sample_words(0, 1, 50) != sample_words(1, 1, 50)


def test_workers_in_their_own_lanes_never_share_a_first_token() -> None:
    # The salts alone let two workers meet whenever their counts drifted by the salts'
    # difference (a CI run against llama-server had one prompt token served from cache).
    nonce = Nonce(tuple(range(279)), 4)  # llama-server's alphabet for the corpus
    salts = [nonce_salt("run", f"w{i:02d}", "process") for i in range(3)]
    firsts = [
        {nonce.apply(list(range(64)), seq, salts[i], (i, 3))[0] for seq in range(2000)}
        for i in range(3)
    ]
    assert all(len(f) == 279 // 3 for f in firsts)  # each lane cycles its own 93 tokens
    assert not (firsts[0] & firsts[1] or firsts[0] & firsts[2] or firsts[1] & firsts[2])
    for i, salt in enumerate(salts):  # and one lane's consecutive 93 requests differ
        run = [nonce.digits(seq, salt, (i, 3))[0] for seq in range(500, 593)]
        assert len(set(run)) == 93
    # without lanes the same salts meet: some pair of counts gives one first token
    plain = [{nonce.digits(seq, s)[0] for seq in range(100)} for s in salts]
    assert plain[0] & plain[1] or plain[0] & plain[2] or plain[1] & plain[2]
    # lanes too narrow for MIN_ALPHABET tokens each fall back to the salt, whole alphabet
    narrow = Nonce(tuple(range(MIN_ALPHABET * 2)), 2)
    assert {narrow.digits(seq, 0, (2, 3))[0] for seq in range(64)} == set(range(16))
    with pytest.raises(ValueError, match="lane"):
        Session(RunContext("r", "w"), "http://127.0.0.1:9", "openai-completions", lane=(3, 3))


@pytest.mark.parametrize("n", [1, 16, 17, 128, 2048, 40959])
def test_id_prompts_have_exactly_n_tokens_on_the_server(fast_sim: SimProcess, n: int) -> None:
    factory = PromptFactory(http_tokenizer(fast_sim.url), mode="ids")
    prompt = factory.prompt(n, sample=3)
    assert prompt.tokens == n
    assert isinstance(prompt.payload, list) and len(prompt.payload) == n
    assert prompt.sample_id == "synthetic:0:3"
    # The server agrees: it reports the prompt length it evaluated.
    status, body = fast_sim.json(
        "POST", "/completion", {"prompt": prompt.payload, "n_predict": 1, "stream": False}
    )
    assert status == 200, body
    assert body["tokens_evaluated"] == n


@pytest.mark.parametrize("n", [20, 128, 1000])
def test_chat_prompts_have_exactly_n_tokens_template_included(fast_sim: SimProcess, n: int) -> None:
    factory = PromptFactory(http_tokenizer(fast_sim.url), mode="chat")
    prompt = factory.prompt(n, sample=1)
    assert isinstance(prompt.payload, str)
    status, body = fast_sim.json(
        "POST",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": prompt.payload}], "max_tokens": 1},
    )
    assert status == 200, body
    assert body["usage"]["prompt_tokens"] == n


def test_out_of_range_and_impossible_prompts_name_the_parameter(fast_sim: SimProcess) -> None:
    factory = PromptFactory(http_tokenizer(fast_sim.url), mode="chat")
    with pytest.raises(WorkloadError, match="prompt_tokens: 0 outside"):
        factory.prompt(0)
    with pytest.raises(WorkloadError, match="prompt_tokens: 40960 outside"):
        factory.prompt(40960)
    with pytest.raises(WorkloadError, match="chat template alone"):
        factory.prompt(2)  # the template is longer than two tokens
    with pytest.raises(WorkloadError, match="mode"):
        PromptFactory(http_tokenizer(fast_sim.url), mode="words")


def test_no_prompt_or_output_text_reaches_the_run_folder(
    fast_sim: SimProcess, tmp_path: Path
) -> None:
    factory = PromptFactory(http_tokenizer(fast_sim.url), mode="chat")
    prompt = factory.prompt(300, sample=5)
    assert isinstance(prompt.payload, str)
    assert "payload" not in repr(prompt)
    sink = PartSink(str(tmp_path), "w1")
    session = Session(RunContext("run", "w1"), fast_sim.url, "openai-chat", sink=sink)
    record, out = run_in_greenlet(
        lambda: session.send(RequestSpec(prompt=prompt, max_tokens=40, concurrency=1))
    )
    session.close()
    sink.close()
    assert out.ok and record.ext.corpus_sample_id == "synthetic:0:5"
    assert record.workload.prompt_tokens == 300 == record.ext.server_prompt_tokens
    blob = b"".join(p.read_bytes() for p in tmp_path.rglob("*") if p.is_file())
    words = prompt.payload.split()
    # Any run of five prompt words would show up if the prompt had been written.
    for i in range(0, len(words) - 5, 25):
        assert " ".join(words[i : i + 5]).encode() not in blob
    assert part_files(str(tmp_path), "requests")
