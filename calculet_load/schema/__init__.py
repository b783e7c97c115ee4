"""The one schema module: every record the project writes or reads is declared here once.

Writers, readers, JSON Schemas and (later) Arrow schemas are derived from these
declarations; nothing else re-declares a column name.
"""

from calculet_load.schema.traces import (
    TRACE_SCHEMA_VERSION,
    VENDOR_TRACE_SCHEMA,
    AuditRow,
    ChipSample,
    DeviceRow,
    ResourceRow,
    ServerEvent,
    ServerEventRow,
    StepRow,
    VendorRow,
    json_schema,
    row_to_dict,
)

__all__ = [
    "TRACE_SCHEMA_VERSION",
    "VENDOR_TRACE_SCHEMA",
    "AuditRow",
    "ChipSample",
    "DeviceRow",
    "ResourceRow",
    "ServerEvent",
    "ServerEventRow",
    "StepRow",
    "VendorRow",
    "json_schema",
    "row_to_dict",
]
