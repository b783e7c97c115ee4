"""Server-side trace rows (spec §2.3, §4; DESIGN §3.2).

Written by the server (the simulator writes them; a real Calculet service is asked to),
read by the analysis. Every row carries the server's wall clock (`wall_ns`, for joining
across hosts only, never for durations) and its monotonic clock (`mono_ns`).
A value the server could not read is ``None`` (JSON null), never 0.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Literal

from pydantic import TypeAdapter

TRACE_SCHEMA_VERSION = 1


class ServerEvent(enum.StrEnum):
    """Event names of `server_events.jsonl`: the §2.3 chain, then runtime and lifecycle."""

    ACCEPTED = "accepted"
    SLOT_ASSIGNED = "slot_assigned"
    ADMITTED = "admitted"
    JOB_PREPARED = "job_prepared"
    SUBMIT_START = "submit_start"
    SUBMIT_OK = "submit_ok"
    WAIT_DONE = "wait_done"
    LOGITS_READY = "logits_ready"
    SAMPLED = "sampled"
    TOKEN_FLUSHED = "token_flushed"
    # request outcomes
    REJECTED = "rejected"
    CANCELLED = "cancelled"
    FINISHED = "finished"
    FAILED = "failed"
    # runtime non-success and recovery
    RUNTIME_ERROR = "runtime_error"
    BACKOFF = "backoff"
    QUARANTINE = "quarantine"
    ARTIFACT_ISOLATED = "artifact_isolated"
    STALE_COMPLETION_BLOCKED = "stale_completion_blocked"
    STALE_COMPLETION_DELIVERED = "stale_completion_delivered"
    NUMERIC_CHECK_FAILED = "numeric_check_failed"
    # lifecycle
    STATE_CHANGE = "state_change"
    RESET = "reset"
    RECONFIGURE = "reconfigure"
    GENERATION_CHANGE = "generation_change"
    FAULT_ARMED = "fault_armed"
    FAULT_CLEARED = "fault_cleared"


StepKind = Literal["prefill", "decode"]


@dataclasses.dataclass(frozen=True, slots=True)
class ServerEventRow:
    """One row of `server_events.jsonl`.

    `step_index` counts generated-token steps of one request from 0 (0 = the prefill
    step that yields the first token). `detail` holds event-specific facts
    (rc, http_status, reason, state before/after, ...).
    """

    wall_ns: int
    mono_ns: int
    event: ServerEvent
    request_id: str | None = None
    job_id: int | None = None
    seq_id: int | None = None
    step_index: int | None = None
    kind: StepKind | None = None
    generation: int | None = None
    detail: dict[str, Any] | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class StepRow:
    """One row of `steps.jsonl`: one request in one device step (spec §4).

    Rows sharing a `job_id` ran in the same device job, so their count is the number of
    active lanes of that step. Durations are milliseconds measured by the server.
    """

    wall_ns: int
    mono_ns: int
    request_id: str
    job_id: int
    seq_id: int
    kind: StepKind
    step: int
    queue_ms: float
    prepare_ms: float
    h2d_ms: float
    device_wait_ms: float
    d2h_ms: float
    bf16_ms: float
    sampling_ms: float
    engine: str
    kv_before: int
    kv_after: int
    output_status: str


@dataclasses.dataclass(frozen=True, slots=True)
class ChipSample:
    """One chip in a device sample; every unit is in the field name; unreadable is None."""

    chip: int
    temperature_c: float | None
    power_w: float | None
    frequency_mhz: float | None
    memory_used_mib: float | None
    memory_total_mib: float | None
    throttled: bool | None


@dataclasses.dataclass(frozen=True, slots=True)
class DeviceRow:
    """One row of `device.jsonl`, sampled every second of (simulated) time (spec §4)."""

    wall_ns: int
    mono_ns: int
    chips: list[ChipSample]
    pending_jobs: int | None
    finished_jobs: int | None
    left_jobs: int | None
    reset_count: int | None
    sim_time_s: float | None = None


VENDOR_TRACE_SCHEMA = "calculet-vendor-trace/v1"


@dataclasses.dataclass(frozen=True, slots=True)
class VendorRow:
    """One row of the optional `server/vendor.jsonl` (spec §10.3, §17): the vendor's own
    counters, which no service trace can give. Schema `calculet-vendor-trace/v1`
    (`calculet-load schema vendor`).

    `kind` "op": one operator's run on one chip, for one request's step
    (`request_id`, `step`; `job_id` when known), with its `cycles` and the bytes it
    moved chip to chip (`d2d_bytes`), to/from device DDR (`ddr_bytes`) and over PCIe
    (`pcie_bytes`). It is joined to the request records by `request_id`, as steps are;
    a row without one counts in the per-op and per-chip totals only.
    `kind` "chip": one chip sampled: its SRAM in use and in total (KiB), and optionally
    its cycles and bytes since the previous sample.
    Counts are integers; a counter the vendor cannot read is None, never 0.
    """

    wall_ns: int
    mono_ns: int
    kind: Literal["op", "chip"]
    chip: int
    request_id: str | None = None
    job_id: int | None = None
    step: int | None = None
    op: str | None = None
    cycles: int | None = None
    d2d_bytes: int | None = None
    ddr_bytes: int | None = None
    pcie_bytes: int | None = None
    sram_used_kib: float | None = None
    sram_total_kib: float | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class AuditRow:
    """One row of the append-only admin audit log (spec §12.4)."""

    wall_ns: int
    mono_ns: int
    operator: str
    action: str
    params: dict[str, Any]
    outcome: str
    http_status: int
    state_before: str
    state_after: str
    generation_before: int
    generation_after: int
    in_flight_jobs: int
    queued_requests: int
    versions: dict[str, Any]


@dataclasses.dataclass(frozen=True, slots=True)
class ResourceRow:
    """One row of `server/resources.jsonl`: the server's resources sampled by the harness
    during a run (spec §13), from its `/metrics` and, with an admin token, `/admin/state`.

    Counts are integers, memory in the unit of its name; a figure the server does not
    expose is None, never 0. `leases` are OutputBuf leases held by sequences; the pool's
    unavailable leases (held, quarantined, leaked) are `leases_total − leases_free`.
    `time_scale` is the simulator's (real seconds per simulated second), None for a
    real server: a leak's slope is per hour of server time.
    """

    wall_ns: int
    mono_ns: int
    rss_bytes: int | None = None
    fds: int | None = None
    threads: int | None = None
    kv_allocated_tokens: int | None = None
    kv_quarantined_tokens: int | None = None
    leases: int | None = None
    leases_free: int | None = None
    leases_total: int | None = None
    device_memory_mib: float | None = None
    sequences_active: int | None = None
    requests_queued: int | None = None
    time_scale: float | None = None
    # long-run KV fragmentation (spec §13 endurance), where the target reports it: free
    # KV blocks, and the largest run of contiguous free KV in tokens
    kv_free_blocks: int | None = None
    kv_largest_free_extent_tokens: int | None = None


_ADAPTERS: dict[type[Any], TypeAdapter[Any]] = {}


def json_schema(row_type: type[Any]) -> dict[str, Any]:
    """The JSON Schema of a trace row type, derived from its declaration."""
    adapter = _ADAPTERS.get(row_type)
    if adapter is None:
        adapter = _ADAPTERS[row_type] = TypeAdapter(row_type)
    schema: dict[str, Any] = adapter.json_schema()
    return schema


def row_to_dict(row: Any) -> dict[str, Any]:
    """A trace row as the plain dict written to JSONL (nested dataclasses included)."""
    out: dict[str, Any] = {}
    for field in dataclasses.fields(row):
        value = getattr(row, field.name)
        if isinstance(value, list):
            value = [row_to_dict(v) if dataclasses.is_dataclass(v) else v for v in value]
        elif isinstance(value, enum.Enum):
            value = value.value
        out[field.name] = value
    return out
