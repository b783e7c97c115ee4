"""The old benchmark CSV (spec §1) as a trend-only, non-authoritative series.

The old script wrote one CSV row per request with llama.cpp's server timings, a
`model` column hard-coded to `deepseek`, and "TTFT" computed as `prompt_ms +
predicted_ms` — server time for the whole response, not the client's first token.
`import_legacy(csv, out)` keeps it for trends only:

    <out>/legacy/trend.parquet   every CSV row and column as written, plus
        row                       1-based CSV row
        legacy_ttft_ms            the old "TTFT" (its ttft_ms column, else prompt_ms +
                                  predicted_ms): server time, NOT a time to first token
        server_prompt_ms          prompt_ms: the server's prompt processing
        server_ms_per_output_token  predicted_ms / predicted_n (null when n = 0)
        model_as_written          the model column (unreliable: hard-coded)
      schema metadata: schema = calculet-legacy-trend/v1, authoritative = false
    <out>/client/index.json      {"legacy": true, "authoritative": false, "source": …}

No request record is written, so nothing in the run folder can enter the statistics of
a measured run. `calculet-load analyze` refuses a legacy folder as the run and as
`--baseline` (exit 2): a new baseline is rebuilt from the client's clock (spec §1).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from analysis.errors import ArtifactError
from calculet_load.schema.fs import resolve_fs
from calculet_load.schema.runfolder import ClientIndex

__all__ = [
    "LEGACY_SCHEMA",
    "LegacyImport",
    "check_not_legacy",
    "import_legacy",
    "legacy_index",
    "load_legacy_trend",
]

LEGACY_SCHEMA = "calculet-legacy-trend/v1"
_TREND = "legacy/trend.parquet"
_WHY = (
    "its TTFT was the server's prompt_ms + predicted_ms and its model label was "
    "hard-coded to deepseek (spec §1)"
)


@dataclass(frozen=True, slots=True)
class LegacyImport:
    out: str
    rows: int
    columns: list[str]
    notes: list[str]


def _column(table: Any, *names: str) -> Any:
    for n in names:
        if n in table.column_names:
            return table.column(n)
    return None


def import_legacy(
    csv_path: str | Path, out: str | Path, *, run_id: str | None = None
) -> LegacyImport:
    """Write the trend-only folder; ArtifactError (exit 2) names what is wrong."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    src = Path(csv_path)
    try:
        data = src.read_bytes()
    except OSError as exc:
        raise ArtifactError(f"{src}: cannot read: {exc.strerror}") from None
    try:
        table = pacsv.read_csv(pa.BufferReader(data))
    except pa.ArrowException as exc:
        raise ArtifactError(f"{src}: not a CSV file: {exc}") from None
    if table.num_rows == 0:
        raise ArtifactError(f"{src}: no rows")
    prompt_ms = _column(table, "prompt_ms")
    predicted_ms = _column(table, "predicted_ms")
    ttft = _column(table, "ttft_ms", "ttft")
    if ttft is None and (prompt_ms is None or predicted_ms is None):
        raise ArtifactError(
            f"{src}: column 'prompt_ms' and 'predicted_ms' (or 'ttft_ms') missing: "
            "not the old benchmark CSV"
        )
    out_dir = Path(out)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise ArtifactError(f"{out_dir}: exists and is not empty: import into a new folder")

    def num(col: Any) -> Any:
        try:
            return pc.cast(col, pa.float64())
        except pa.ArrowInvalid:
            raise ArtifactError(f"{src}: a timing column is not numeric") from None

    notes = [f"legacy import, trend reference only: {_WHY}"]
    summed = num(prompt_ms) if prompt_ms is not None else None
    if summed is not None and predicted_ms is not None:
        summed = pc.add(summed, num(predicted_ms))
    legacy_ttft = num(ttft) if ttft is not None else summed
    if ttft is not None and summed is not None:
        off = pc.greater(pc.abs(pc.subtract(num(ttft), summed)), 0.01)
        n_off = int(pc.sum(pc.fill_null(off, False)).as_py() or 0)
        if n_off:
            notes.append(f"{n_off} rows' ttft_ms differ from prompt_ms + predicted_ms")
    n = table.num_rows
    nulls = pa.nulls(n, pa.float64())
    predicted_n = _column(table, "predicted_n", "tokens_predicted")
    per_token = nulls
    if predicted_ms is not None and predicted_n is not None:
        count = num(predicted_n)
        positive = pc.greater(count, 0)
        per_token = pc.if_else(positive, pc.divide(num(predicted_ms), count), nulls)
    model = _column(table, "model")
    derived = {
        "row": pa.array(range(1, n + 1), pa.int64()),
        "legacy_ttft_ms": legacy_ttft,
        "server_prompt_ms": num(prompt_ms) if prompt_ms is not None else nulls,
        "server_ms_per_output_token": per_token,
        "model_as_written": pc.cast(model, pa.string())
        if model is not None
        else pa.nulls(n, pa.string()),
    }
    if model is not None:
        models = sorted({str(m) for m in model.unique().drop_null().to_pylist()})
        notes.append(f"model column as written: {', '.join(models)} (not trusted)")
    for name, col in derived.items():
        i = table.schema.get_field_index(name)
        table = table.set_column(i, name, col) if i >= 0 else table.append_column(name, col)
    meta = {"schema": LEGACY_SCHEMA, "authoritative": "false", "source": src.name}
    table = table.replace_schema_metadata(meta)
    (out_dir / "legacy").mkdir(parents=True, exist_ok=True)
    (out_dir / "client").mkdir(parents=True, exist_ok=True)
    pq.write_table(table, out_dir / _TREND)
    ClientIndex(
        run_id=run_id or f"legacy-{src.stem}",
        status="complete",
        legacy=True,
        authoritative=False,
        source={
            "file": src.name,
            "sha256": hashlib.sha256(data).hexdigest(),
            "rows": n,
            "columns": [c for c in table.column_names if c not in derived],
        },
        trend=_TREND,
        notes=notes,
        workers=[],
    ).write(str(out_dir))
    return LegacyImport(str(out_dir), n, list(table.column_names), notes)


def legacy_index(uri: str) -> dict[str, Any] | None:
    """The index of a legacy import at `uri`, None for any other folder."""
    import pyarrow.fs as pafs

    fs, root = resolve_fs(uri)
    path = f"{root.rstrip('/')}/client/index.json"
    if fs.get_file_info(path).type != pafs.FileType.File:
        return None
    try:
        with fs.open_input_stream(path) as f:
            doc = json.loads(f.read())
    except (OSError, ValueError):
        return None  # the loader reports an unreadable index itself
    return doc if isinstance(doc, dict) and doc.get("legacy") is True else None


def check_not_legacy(uri: str, role: str) -> None:
    """ArtifactError (exit 2) when `uri` is a legacy import: never judged, never a
    baseline."""
    if legacy_index(uri) is None:
        return
    if role == "baseline":
        raise ArtifactError(
            f"{uri}: a legacy CSV import cannot be a baseline: {_WHY}; it is a trend "
            "reference only. Use a run measured by calculet-load as the baseline"
        )
    raise ArtifactError(
        f"{uri}: a legacy CSV import is a trend reference only ({_WHY}): it has no "
        "request records to judge"
    )


def load_legacy_trend(uri: str) -> Any:
    """The trend table of a legacy import (pyarrow.Table); ArtifactError otherwise."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if legacy_index(uri) is None:
        raise ArtifactError(f"{uri}: not a legacy import (no legacy: true in client/index.json)")
    fs, root = resolve_fs(uri)
    path = f"{root.rstrip('/')}/{_TREND}"
    try:
        table = pq.read_table(path, filesystem=fs)
    except (OSError, pa.ArrowException) as exc:
        raise ArtifactError(f"{path}: unreadable: {exc}") from None
    if (table.schema.metadata or {}).get(b"schema") != LEGACY_SCHEMA.encode():
        raise ArtifactError(f"{path}: not a {LEGACY_SCHEMA} table")
    return table
