"""Tests for calculet_load.measure.sse, and measurements of sseclient-py 1.9 on the same inputs.

The oracle `reference_parse` transcribes the WHATWG HTML "event stream interpretation"
rules literally: decode the whole stream, then walk it character by character. The parser
under test cuts lines on bytes first and decodes line by line; the properties below check
that the two agree, and that no way of splitting a stream into reads changes the result.
"""

import codecs
import json
import pickle
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sseclient import SSEClient

from calculet_load.clock import FakeClock
from calculet_load.measure.sse import SSEEvent, SSELineTooLong, SSEParser

SHARED = Path(__file__).resolve().parents[2].parent / "shared"
LLAMA_CPP_SAMPLES = SHARED / "protocol-samples" / "llama.cpp"
BOM = b"\xef\xbb\xbf"


@dataclass(frozen=True)
class Outcome:
    events: list[SSEEvent]
    comments: int
    invalid_utf8: int
    last_event_id: str | None
    retry_ms: int | None
    truncated: bool


def parse(chunks: Iterable[bytes], max_line_bytes: int = 1 << 20) -> Outcome:
    parser = SSEParser(max_line_bytes)
    events: list[SSEEvent] = []
    for chunk in chunks:
        events += parser.feed(chunk)
    events += parser.close()
    return Outcome(
        events,
        parser.comments,
        parser.invalid_utf8,
        parser.last_event_id,
        parser.retry_ms,
        parser.truncated,
    )


def split_at(stream: bytes, cuts: Iterable[int]) -> list[bytes]:
    bounds = [0, *sorted(set(cuts)), len(stream)]
    return [stream[a:b] for a, b in pairwise(bounds)]


def data_of(events: Iterable[SSEEvent]) -> list[str]:
    return [e.data for e in events]


# --- the oracle ------------------------------------------------------------------------

_replaced = [0]


def _count_and_replace(exc: UnicodeError) -> tuple[str, int]:
    assert isinstance(exc, UnicodeDecodeError)
    _replaced[0] += 1
    return "\ufffd", exc.end


codecs.register_error("test_sse.count_and_replace", _count_and_replace)


def reference_parse(stream: bytes) -> Outcome:
    """WHATWG HTML §9.2.6 (event stream interpretation), literally, on a whole stream."""
    _replaced[0] = 0
    decoder = codecs.getincrementaldecoder("utf-8")("test_sse.count_and_replace")
    text = decoder.decode(stream, final=True)
    invalid = _replaced[0]
    if text.startswith("\ufeff"):
        text = text[1:]
    lines: list[str] = []
    start = i = 0
    while i < len(text):
        if text[i] == "\r":
            lines.append(text[start:i])
            i += 2 if text[i + 1 : i + 2] == "\n" else 1
            start = i
        elif text[i] == "\n":
            lines.append(text[start:i])
            i += 1
            start = i
        else:
            i += 1
    tail = text[start:]

    events: list[SSEEvent] = []
    data = event_type = ""
    id_buffer: str | None = None
    last_event_id: str | None = None
    retry: int | None = None
    comments = 0
    pending = False
    for line in lines:
        if line == "":
            pending = False
            last_event_id = id_buffer
            if data == "":
                event_type = ""
                continue
            if data.endswith("\n"):
                data = data[:-1]
            events.append(SSEEvent(data, event_type or "message", last_event_id, retry))
            data = event_type = ""
            continue
        if line.startswith(":"):
            comments += 1
            continue
        pending = True
        if ":" in line:
            name, value = line.split(":", 1)
            if value.startswith(" "):
                value = value[1:]
        else:
            name, value = line, ""
        if name == "data":
            data += value + "\n"
        elif name == "event":
            event_type = value
        elif name == "id":
            if "\x00" not in value:
                id_buffer = value
        elif name == "retry" and value and all(c in "0123456789" for c in value):
            retry = int(value)
    return Outcome(events, comments, invalid, last_event_id, retry, tail != "" or pending)


# --- strategies ------------------------------------------------------------------------

_PIECES = [
    b"\n", b"\r", b"\r\n", b":", b" ", b"data", b"data:", b"data: ", b"event:", b"event: e",
    b"id:", b"id: 7", b"id", b"retry:", b"retry: 15", b"retry:1x", b"0", b"9", b"x", b"\x00",
    BOM, "é".encode(), "你".encode(), "😀".encode(), b"\xe4\xbd", b"\xff", b"\xf0\x9f",
    b"\xef\xbf\xbd", b"\xed\xa0\x80",
]  # fmt: skip
streams = st.one_of(
    st.lists(st.sampled_from(_PIECES), max_size=40).map(b"".join),
    st.binary(max_size=64),
)


@settings(max_examples=400, deadline=None)
@given(streams)
def test_whole_stream_matches_the_spec_transcription(stream: bytes) -> None:
    assert parse([stream]) == reference_parse(stream)


@settings(max_examples=400, deadline=None)
@given(streams, st.data())
def test_any_split_into_reads_gives_the_same_result(stream: bytes, data: st.DataObject) -> None:
    cuts = data.draw(st.lists(st.integers(0, len(stream)), max_size=10))
    whole = parse([stream])
    assert parse(split_at(stream, cuts)) == whole
    assert parse([bytes([b]) for b in stream]) == whole


@settings(max_examples=300, deadline=None)
@given(streams, st.data(), st.integers(1, 12))
def test_line_limit_fires_at_the_same_line_whatever_the_split(
    stream: bytes, data: st.DataObject, limit: int
) -> None:
    def run(chunks: list[bytes]) -> tuple[list[SSEEvent], int | None]:
        parser = SSEParser(limit)
        events: list[SSEEvent] = []
        try:
            for chunk in chunks:
                events += parser.feed(chunk)
        except SSELineTooLong as exc:
            return events + exc.events, exc.offset
        return events, None

    cuts = data.draw(st.lists(st.integers(0, len(stream)), max_size=10))
    whole = run([stream])
    assert run(split_at(stream, cuts)) == whole
    offset = whole[1]
    if offset is not None:
        rest = stream[offset:]
        line_end = min(
            (i for i in (rest.find(b"\r"), rest.find(b"\n")) if i >= 0), default=len(rest)
        )
        assert line_end > limit
        assert offset in (0, 3) or stream[offset - 1 : offset] in (b"\r", b"\n")


# --- known answers: the examples of the WHATWG spec ---------------------------------------


def test_spec_example_three_messages() -> None:
    stream = (
        b"data: This is the first message.\n\n"
        b"data: This is the second message, it\n"
        b"data: has two lines.\n\n"
        b"data: This is the third message.\n\n"
    )
    assert data_of(parse([stream]).events) == [
        "This is the first message.",
        "This is the second message, it\nhas two lines.",
        "This is the third message.",
    ]


def test_spec_example_event_types() -> None:
    stream = (
        b"event: add\ndata: 73857293\n\nevent: remove\ndata: 2153\n\nevent: add\ndata: 113411\n\n"
    )
    assert [(e.event, e.data) for e in parse([stream]).events] == [
        ("add", "73857293"),
        ("remove", "2153"),
        ("add", "113411"),
    ]


def test_spec_example_stock_ticker() -> None:
    assert parse([b"data: YHOO\ndata: +2\ndata: 10\n\n"]).events == [SSEEvent("YHOO\n+2\n10")]


def test_spec_example_comment_and_ids() -> None:
    stream = (
        b": test stream\n\n"
        b"data: first event\nid: 1\n\n"
        b"data:second event\nid\n\n"
        b"data:  third event\n\n"
    )
    out = parse([stream])
    assert out.events == [
        SSEEvent("first event", id="1"),
        SSEEvent("second event", id=""),
        SSEEvent(" third event", id=""),
    ]
    assert out.comments == 1
    assert out.last_event_id == ""


def test_spec_example_empty_data_and_unterminated_last_block() -> None:
    out = parse([b"data\n\ndata\ndata\n\ndata:"])
    assert data_of(out.events) == ["", "\n"]
    assert out.truncated


def test_spec_example_space_after_colon_is_optional() -> None:
    assert data_of(parse([b"data:test\n\ndata: test\n\n"]).events) == ["test", "test"]


# --- line endings ----------------------------------------------------------------------


@pytest.mark.parametrize("eol", [b"\n", b"\r\n", b"\r"], ids=["LF", "CRLF", "CR"])
def test_every_line_ending_gives_the_same_events(eol: bytes) -> None:
    stream = b"event: a\ndata: 1\ndata: 2\n\n: ping\n\ndata: 3\n\n".replace(b"\n", eol)
    out = parse([stream])
    assert out.events == [SSEEvent("1\n2", "a"), SSEEvent("3")]
    assert out.comments == 1


@pytest.mark.parametrize(
    "stream",
    [b"data: a\n\r\ndata: b\n\n", b"data: a\n\rdata: b\n\n", b"data: a\r\r\ndata: b\n\n"],
    ids=["LF-then-CRLF", "LF-then-CR", "CR-then-CRLF"],
)
def test_mixed_line_endings_separate_events(stream: bytes) -> None:
    assert data_of(parse([stream]).events) == ["a", "b"]


def test_crlf_split_between_reads_is_one_line_ending() -> None:
    # Were the LF read as a second line ending, it would be a blank line dispatching "a".
    assert data_of(parse([b"data: a\r", b"\ndata: b\r\n\r\n"]).events) == ["a\nb"]


def test_split_crlf_survives_an_empty_read() -> None:
    assert data_of(parse([b"data: a\r", b"", b"\ndata: b\n\n"]).events) == ["a\nb"]


def test_event_ending_in_cr_is_dispatched_at_the_cr_without_waiting_for_the_lf() -> None:
    parser = SSEParser()
    assert parser.feed(b"data: a\r\n\r") == [SSEEvent("a")]
    assert parser.feed(b"\n") == []
    assert parser.feed(b"data: b\r\n\r\n") == [SSEEvent("b")]


def test_lf_after_a_cr_split_is_skipped_only_once() -> None:
    parser = SSEParser()
    assert parser.feed(b"data: a\r") == []
    assert parser.feed(b"\n\n") == [SSEEvent("a")]


# --- BOM and UTF-8 -----------------------------------------------------------------------


def test_leading_bom_is_stripped_once_even_when_split() -> None:
    stream = BOM + b"data: a\n\n" + BOM + b"data: b\n\n"
    # A second BOM starts the field name "\ufeffdata", an unknown field.
    for cuts in ([], [1], [2], [1, 2]):
        assert data_of(parse(split_at(stream, cuts)).events) == ["a"]


def test_stream_of_a_bom_alone_is_not_truncated_but_half_a_bom_is() -> None:
    assert not parse([BOM]).truncated
    half = parse([BOM[:2]])
    assert half.truncated
    assert half.invalid_utf8 == 1


@pytest.mark.parametrize("char", ["é", "你", "😀"])
def test_multibyte_character_split_across_reads_survives(char: str) -> None:
    stream = f"data: {char}\n\n".encode()
    for cut in range(len(stream) + 1):
        out = parse(split_at(stream, [cut]))
        assert out.events == [SSEEvent(char)]
        assert out.invalid_utf8 == 0


def test_invalid_utf8_is_replaced_and_counted_but_a_real_replacement_char_is_not() -> None:
    out = parse([b"data: \xff\xfe|\xe4\xbd|\xef\xbf\xbd\n: \xff\n\n"])
    # \xff and \xfe: two invalid bytes; \xe4\xbd: one truncated sequence; then a valid U+FFFD.
    assert out.events == [SSEEvent("\ufffd\ufffd|\ufffd|\ufffd")]
    assert out.invalid_utf8 == 4  # 3 in the data line + 1 in the comment


def test_invalid_utf8_in_an_unterminated_last_line_is_counted() -> None:
    out = parse([b"data: a\n\ndata: \xff"])
    assert out.invalid_utf8 == 1
    assert out.truncated


# --- fields ------------------------------------------------------------------------------


def test_field_without_colon_has_an_empty_value() -> None:
    assert parse([b"data\ndata\n\n"]).events == [SSEEvent("\n")]


def test_only_one_space_after_the_colon_is_removed() -> None:
    assert parse([b"data:  two\n\ndata:\tx\n\n"]).events == [SSEEvent(" two"), SSEEvent("\tx")]


def test_field_names_are_case_sensitive_and_unknown_fields_ignored() -> None:
    assert parse([b"Data: x\ndata : y\nfoo: z\n\ndata: ok\n\n"]).events == [SSEEvent("ok")]


def test_event_type_resets_after_each_blank_line_even_without_dispatch() -> None:
    events = parse([b"event: a\n\ndata: 1\n\nevent: b\ndata: 2\n\ndata: 3\n\n"]).events
    assert [(e.event, e.data) for e in events] == [("message", "1"), ("b", "2"), ("message", "3")]


def test_empty_event_field_means_message() -> None:
    assert parse([b"event:\ndata: x\n\n"]).events == [SSEEvent("x", "message")]


def test_block_without_data_is_not_dispatched_but_its_id_is_taken() -> None:
    out = parse([b"id: 5\n\n"])
    assert out.events == []
    assert out.last_event_id == "5"


def test_id_persists_and_is_reset_by_an_empty_id() -> None:
    events = parse([b"id: 1\ndata: a\n\ndata: b\n\nid\ndata: c\n\n"]).events
    assert [e.id for e in events] == ["1", "1", ""]


def test_id_is_updated_only_at_the_blank_line() -> None:
    parser = SSEParser()
    parser.feed(b"id: 1\ndata: a\n\nid: 2\n")
    assert parser.last_event_id == "1"
    parser.feed(b"\n")
    assert parser.last_event_id == "2"


def test_id_containing_nul_is_ignored() -> None:
    assert parse([b"id: 1\n\nid: 2\x003\ndata: a\n\n"]).events == [SSEEvent("a", id="1")]


@pytest.mark.parametrize(
    ("value", "expected"),
    [(b"1500", 1500), (b"0", 0), (b"", None), (b"15x", None), (b" 15", None), (b"-1", None),
     (b"1.5", None), ("١٥".encode(), None), (b"1" * 5000, None)],
)  # fmt: skip
def test_retry_is_taken_only_if_all_ascii_digits(value: bytes, expected: int | None) -> None:
    out = parse([b"retry: " + value + b"\ndata: x\n\n"])
    assert out.retry_ms == expected
    assert out.events == [SSEEvent("x", retry_ms=expected)]


def test_retry_persists_across_events_and_needs_no_data() -> None:
    out = parse([b"retry: 100\n\ndata: a\n\nretry: x\ndata: b\n\n"])
    assert [e.retry_ms for e in out.events] == [100, 100]


# --- end of stream -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("stream", "truncated"),
    [
        (b"data: a\n\n", False),
        (b"data: a\n\n: ping\n", False),
        (b"data: a\n\ndata: b", True),
        (b"data: a\n\ndata: b\n", True),
        (b"data: a\n\nid: 3\n", True),
        (b"data: a\n\n:", True),
        (b"data: a\n\ndata: b\r", True),
        (b"", False),
    ],
)
def test_close_discards_the_unterminated_event(stream: bytes, truncated: bool) -> None:
    out = parse([stream])
    assert data_of(out.events) == (["a"] if stream else [])
    assert out.truncated is truncated


def test_truncated_is_false_before_close_and_close_is_idempotent() -> None:
    parser = SSEParser()
    parser.feed(b"data: a")
    assert not parser.truncated
    assert parser.close() == []
    assert parser.truncated
    assert parser.close() == []
    assert parser.truncated


def test_feed_after_close_is_refused() -> None:
    parser = SSEParser()
    parser.close()
    with pytest.raises(ValueError, match="after close"):
        parser.feed(b"data: a\n\n")


# --- the line limit ----------------------------------------------------------------------


def test_line_of_exactly_the_limit_passes_and_one_more_byte_fails() -> None:
    assert parse([b"data:1234\r\n\r\n"], max_line_bytes=9).events == [SSEEvent("1234")]
    parser = SSEParser(max_line_bytes=9)
    with pytest.raises(SSELineTooLong, match="byte offset 10 ") as info:
        parser.feed(b"data: ok\n\ndata:12345\n\n")
    assert isinstance(info.value, ValueError)
    assert info.value.offset == 10
    assert info.value.events == [SSEEvent("ok")]


def test_line_limit_fires_before_the_line_ends_and_keeps_firing() -> None:
    parser = SSEParser(max_line_bytes=8)
    assert parser.feed(BOM + b"data: 12") == []
    with pytest.raises(SSELineTooLong) as info:
        parser.feed(b"3")
    assert info.value.offset == 3  # the BOM counts as stream bytes
    with pytest.raises(SSELineTooLong, match="offset 3 "):
        parser.feed(b"\n\n")
    parser.close()
    assert parser.truncated


def test_line_too_long_survives_pickling() -> None:
    exc = pickle.loads(pickle.dumps(SSELineTooLong(7, 4, [SSEEvent("a")])))
    assert (exc.offset, exc.limit, exc.events, str(exc)) == (
        7,
        4,
        [SSEEvent("a")],
        "SSE line starting at byte offset 7 is longer than 4 bytes",
    )


def test_limit_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_line_bytes"):
        SSEParser(0)


# --- real llama.cpp captures -------------------------------------------------------------


def _capture(name: str) -> bytes:
    path = LLAMA_CPP_SAMPLES / name
    if not path.is_file():
        pytest.skip(f"{path} is absent: the llama.cpp captures live in ../shared beside the repo")
    return path.read_bytes()


CAPTURES = [
    "completion-stream.sse",
    "chat-stream.sse",
    "chat-stream-no-usage.sse",
    "v1-completions-stream.sse",
]


@pytest.mark.parametrize("name", CAPTURES)
def test_llama_cpp_capture_parses_the_same_whatever_the_reads(name: str) -> None:
    raw = _capture(name)
    out = parse([raw])
    assert len(out.events) == raw.count(b"data: ") > 3
    assert (out.comments, out.invalid_utf8, out.truncated) == (0, 0, False)
    assert {e.event for e in out.events} == {"message"}
    assert parse([bytes([b]) for b in raw]) == out
    assert parse([raw.replace(b"\n", b"\r\n")]) == out
    assert parse([raw.replace(b"\n", b"\r")]) == out

    payloads = [e.data for e in out.events]
    if name == "completion-stream.sse":
        # The native endpoint has no [DONE]: the stream ends with the stop event.
        events = [json.loads(p) for p in payloads]
        assert [e["stop"] for e in events] == [False] * (len(events) - 1) + [True]
        assert events[-1]["timings"]["predicted_n"] == events[-1]["tokens_predicted"]
    else:
        assert payloads[-1] == "[DONE]"
        assert all(isinstance(json.loads(p), dict) for p in payloads[:-1])


def test_llama_cpp_capture_keeps_multibyte_text_split_across_reads() -> None:
    raw = _capture("v1-completions-stream.sse")
    assert any(b >= 0x80 for b in raw)
    text = "".join(json.loads(e.data)["choices"][0]["text"] for e in parse([raw]).events[:-1])
    split = parse([bytes([b]) for b in raw]).events[:-1]
    assert "".join(json.loads(e.data)["choices"][0]["text"] for e in split) == text
    assert any(ord(c) > 0x7F for c in text)


# --- sseclient-py 1.9, measured ----------------------------------------------------------
# Each test drives sseclient.SSEClient over a list of reads and asserts what 1.9 does,
# next to what the rules say. A test here failing means sseclient-py changed: re-measure.


def sseclient_events(chunks: list[bytes]) -> list[tuple[str, str, str | None, str | None, int]]:
    """(event, data, id, retry, index of the last read pulled when the event was yielded)."""
    pulled = [-1]

    def reads() -> Iterator[bytes]:
        for i, chunk in enumerate(chunks):
            pulled[0] = i
            yield chunk

    return [(e.event, e.data, e.id, e.retry, pulled[0]) for e in SSEClient(reads()).events()]


def our_events(chunks: list[bytes]) -> list[tuple[str, str, str | None, int | None, int]]:
    parser = SSEParser()
    out = [
        (e.event, e.data, e.id, e.retry_ms, i) for i, c in enumerate(chunks) for e in parser.feed(c)
    ]
    parser.close()
    return out


def test_sseclient_stamps_an_event_whose_crlf_is_split_at_the_next_read() -> None:
    chunks = [b"data: a\r\n\r", b"\n", b"data: b\r\n\r\n"]

    def stamps(events_of: Iterator[str], clock: FakeClock) -> dict[str, int]:
        return {data: clock.mono_ns() for data in events_of}

    def timed_reads(clock: FakeClock) -> Iterator[bytes]:
        for chunk in chunks:
            clock.advance(25_000_000)  # one read every 25 ms
            yield chunk

    theirs_clock = FakeClock()
    theirs = stamps((e.data for e in SSEClient(timed_reads(theirs_clock)).events()), theirs_clock)
    ours_clock = FakeClock()
    parser = SSEParser()
    ours = stamps(
        (e.data for chunk in timed_reads(ours_clock) for e in parser.feed(chunk)), ours_clock
    )
    # "a" is complete at the CR of the 25 ms read; sseclient hands it over with the 50 ms one.
    assert theirs == {"a": 50_000_000, "b": 75_000_000}
    assert ours == {"a": 25_000_000, "b": 75_000_000}


def test_sseclient_yields_before_pulling_the_next_read_on_lf_streams() -> None:
    # Honest result: sseclient pulls reads from an iterator (no push API), but lazily:
    # An event complete in read i is yielded before read i + 1 is pulled, so a source
    # wrapper could stamp reads. Fed one byte per read, it matches us exactly.
    stream = b"data: a\n\n: ping\ndata: b\ndata: c\n\n"
    chunks = [bytes([b]) for b in stream]
    assert sseclient_events(chunks) == [
        ("message", "a", None, None, 8),
        ("message", "b\nc", None, None, len(stream) - 1),
    ]
    assert [e[:2] + e[4:] for e in sseclient_events(chunks)] == [
        e[:2] + e[4:] for e in our_events(chunks)
    ]


@pytest.mark.parametrize(
    "chunks",
    [[b"data: a\r\rdata: b\r\r"], [b"data: a\r", b"\rdata: b\r", b"\r"]],
    ids=["whole", "CR-split"],
)
def test_sseclient_handles_lone_cr_line_endings(chunks: list[bytes]) -> None:
    # Honest result: consistent lone-CR streams work, split or not.
    assert [e[1] for e in sseclient_events(chunks)] == ["a", "b"]
    assert [e[1] for e in our_events(chunks)] == ["a", "b"]


def test_sseclient_keeps_a_multibyte_character_split_across_reads() -> None:
    # Honest result: sseclient joins raw bytes before decoding, so this works.
    chunks = [b"data: \xe4\xbd", b"\xa0\n\n"]
    assert sseclient_events(chunks) == [("message", "你", None, None, 1)]
    assert our_events(chunks) == [("message", "你", None, None, 1)]


@pytest.mark.parametrize(
    "stream",
    [b"data: a\n\r\ndata: b\n\n", b"data: a\n\rdata: b\n\n", b"data: a\r\r\ndata: b\n\n"],
    ids=["LF-then-CRLF", "LF-then-CR", "CR-then-CRLF"],
)
def test_sseclient_merges_events_separated_by_mixed_line_endings(stream: bytes) -> None:
    # It looks for a blank line only as b"\r\r", b"\n\n" or b"\r\n\r\n" at the buffer end.
    assert [e[1] for e in sseclient_events([stream])] == ["a\nb"]
    assert [e[1] for e in our_events([stream])] == ["a", "b"]


def test_sseclient_dispatches_an_unterminated_event_at_end_of_stream() -> None:
    chunks = [b"data: a\n\ndata: b"]
    assert [e[1] for e in sseclient_events(chunks)] == ["a", "b"]
    assert [e[1] for e in our_events(chunks)] == ["a"]


def test_sseclient_drops_the_first_event_after_a_bom() -> None:
    chunks = [BOM + b"data: a\n\ndata: b\n\n"]
    assert [e[1] for e in sseclient_events(chunks)] == ["b"]
    assert [e[1] for e in our_events(chunks)] == ["a", "b"]


def test_sseclient_raises_on_invalid_utf8() -> None:
    with pytest.raises(UnicodeDecodeError):
        sseclient_events([b"data: \xff\n\n"])
    assert [e[1] for e in our_events([b"data: \xff\n\n"])] == ["\ufffd"]


def test_sseclient_forgets_the_last_event_id_and_takes_an_id_with_nul() -> None:
    chunks = [b"id: 1\ndata: a\n\ndata: b\n\nid: 2\x003\ndata: c\n\n"]
    assert [e[2] for e in sseclient_events(chunks)] == ["1", None, "2\x003"]
    assert [e[2] for e in our_events(chunks)] == ["1", "1", "1"]


def test_sseclient_passes_retry_through_as_an_unchecked_string() -> None:
    chunks = [b"retry: 100\ndata: a\n\nretry: soon\ndata: b\n\n"]
    assert [e[3] for e in sseclient_events(chunks)] == ["100", "soon"]
    assert [e[3] for e in our_events(chunks)] == [100, 100]


@pytest.mark.parametrize("name", CAPTURES)
def test_sseclient_agrees_with_us_on_the_llama_cpp_captures(name: str) -> None:
    # Honest result: LF-only, BOM-less, valid UTF-8, terminated: sseclient gets these right.
    raw = _capture(name)
    chunks = [raw[i : i + 97] for i in range(0, len(raw), 97)]
    assert [e[:2] for e in sseclient_events(chunks)] == [e[:2] for e in our_events(chunks)]
