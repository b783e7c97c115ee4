"""Small file commands: `check-manifest`, `schema`, `export`."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from calculet_load.schema.manifest import ManifestError, load_manifest, manifest_json_schema


def add_check_manifest(p: argparse.ArgumentParser) -> None:
    p.add_argument("manifest", help="run manifest YAML")


def check_manifest(args: argparse.Namespace) -> int:
    """Exit 0 and print the run id when valid; exit 2 with one line naming the field."""
    try:
        m = load_manifest(args.manifest)
    except ManifestError as exc:
        print(exc, file=sys.stderr)
        return 2
    print(f"{args.manifest}: valid ({m.run_id})")
    return 0


def _schemas() -> dict[str, Any]:
    from calculet_load.schema.records import request_json_schema
    from calculet_load.schema.scrape import MetricsScrapeRow, ProcessRow
    from calculet_load.schema.traces import AuditRow, DeviceRow, ServerEventRow, StepRow
    from calculet_load.schema.traces import json_schema as trace_schema
    from calculet_load.workload.matrix import GoldenSet, matrix_json_schema
    from calculet_load.workload.mixes import mix_json_schema

    return {
        "manifest": manifest_json_schema,
        "mix": mix_json_schema,
        "matrix": matrix_json_schema,
        "golden": lambda: GoldenSet.model_json_schema(by_alias=True),
        "request": request_json_schema,
        "server_events": lambda: trace_schema(ServerEventRow),
        "steps": lambda: trace_schema(StepRow),
        "device": lambda: trace_schema(DeviceRow),
        "audit": lambda: trace_schema(AuditRow),
        "vendor": _vendor_schema,
        "server_metrics": lambda: trace_schema(MetricsScrapeRow),
        "server_process": lambda: trace_schema(ProcessRow),
        "faults": _fault_scenario_schema,
        "soak": _soak_stage_schema,
    }


def _vendor_schema() -> dict[str, Any]:
    """The vendor trace's row (server/vendor.jsonl), titled with its schema version."""
    from calculet_load.schema.traces import VENDOR_TRACE_SCHEMA, VendorRow
    from calculet_load.schema.traces import json_schema as trace_schema

    return {**trace_schema(VendorRow), "title": VENDOR_TRACE_SCHEMA}


def _soak_stage_schema() -> dict[str, Any]:
    from calculet_drivers.soak.stage import stage_json_schema

    return stage_json_schema()


def _fault_scenario_schema() -> dict[str, Any]:
    from calculet_drivers.faults.spec import scenario_json_schema

    return scenario_json_schema()


def add_schema(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", choices=sorted(_schemas()), help="which JSON Schema to print")


def schema(args: argparse.Namespace) -> int:
    print(json.dumps(_schemas()[args.name](), indent=2))
    return 0


def add_export(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="run folder (local path or URI)")
    p.add_argument("--out", help="output file (default: stdout)")
    p.add_argument(
        "--full", action="store_true", help="include the `ext` group (default: exactly §3)"
    )
    p.add_argument(
        "--no-join",
        action="store_true",
        help="the records as the client wrote them: no server_ms/runtime_ms from the traces",
    )


def export(args: argparse.Namespace) -> int:
    """The run's request records as JSON lines, joined with the run's server traces (the
    analysis's join): server_ms, runtime_ms, quality.server_trace_joined
    and quality.throttled filled where a record joined; the others keep their nulls."""
    from calculet_load.schema.runfolder import export_jsonl, part_files

    table = None
    if not args.no_join and part_files(args.run_dir, "requests"):
        from analysis.errors import AnalysisError
        from analysis.tables.join import load_run

        try:
            table = load_run(args.run_dir).requests
        except AnalysisError as exc:  # one line and its exit code
            print(f"calculet-load export: {exc}", file=sys.stderr)
            return int(exc.exit_code)
    out = open(args.out, "w", encoding="utf-8") if args.out else sys.stdout  # noqa: SIM115
    try:
        n = export_jsonl(args.run_dir, out, strict=not args.full, table=table)
    finally:
        if args.out:
            out.close()
    if table is None:
        joined = "not joined" + (" (--no-join)" if args.no_join else "")
    else:
        col = table.column("quality.server_trace_joined").to_pylist()
        joined = f"{sum(1 for x in col if x)} of {n} joined to a server trace"
    where = f" to {args.out}" if args.out else ""
    print(f"{n} records written{where}; {joined}", file=sys.stderr)
    return 0
