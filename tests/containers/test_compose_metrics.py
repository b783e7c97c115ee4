"""The `metrics` profile of docker-compose.yml: Prometheus and Grafana, checked as data.

Without a Docker engine, the profile is held to what the containers need: the files it
mounts exist, Prometheus scrapes the services and ports the other services' commands
listen on, Grafana's provisioning names the datasource the dashboard refers to and the
folder the dashboard is mounted in, and the dashboard is a well-formed Grafana model
whose PromQL parses into known functions. `promtool check config` runs when promtool is
on PATH. That the dashboard reads only series the exporters produce is checked live in
tests/locust/test_metrics_live.py.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support import dashboard as dash_mod

REPO = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((REPO / "docker-compose.yml").read_text())
SERVICES: dict[str, dict[str, Any]] = COMPOSE["services"]
PROMETHEUS_YML = REPO / "deploy" / "prometheus" / "prometheus.yml"
PROVISIONING = REPO / "deploy" / "grafana" / "provisioning"


def _value(cmd: list[str], flag: str) -> str:
    assert flag in cmd, (flag, cmd)
    return cmd[cmd.index(flag) + 1]


def _mounts(service: dict[str, Any]) -> dict[str, Path]:
    """container path -> repo path of the service's bind mounts (read-only or not)."""
    out = {}
    for v in service.get("volumes", []):
        host, container, *_ = v.split(":")
        if host.startswith("./"):
            out[container] = REPO / host
    return out


def test_the_profile_is_off_by_default_and_pinned() -> None:
    extra = {n for n, s in SERVICES.items() if s.get("profiles") == ["metrics"]}
    assert extra == {"prometheus", "grafana"}
    for name in extra:
        s = SERVICES[name]
        assert s["profiles"] == ["metrics"], name
        _, _, tag = s["image"].partition(":")
        assert tag and tag != "latest", f"{name}: pin the image ({s['image']})"
        for container, host in _mounts(s).items():
            assert host.exists(), f"{name}: {host} (mounted at {container}) is not in the repo"


def test_prometheus_scrapes_the_master_and_the_server() -> None:
    prom = SERVICES["prometheus"]
    config_path = next(a for a in prom["command"] if a.startswith("--config.file="))
    assert _mounts(prom)[config_path.split("=", 1)[1]] == PROMETHEUS_YML
    config = yaml.safe_load(PROMETHEUS_YML.read_text())
    targets = {
        job["job_name"]: (job.get("metrics_path", "/metrics"), t)
        for job in config["scrape_configs"]
        for sc in job["static_configs"]
        for t in sc["targets"]
    }
    master, sim = SERVICES["master"]["command"], SERVICES["sim"]["command"]
    assert targets["calculet-load"] == ("/metrics", f"master:{_value(master, '--metrics-port')}")
    assert targets["calculet-server"] == ("/metrics", f"sim:{_value(sim, '--port')}")
    assert _value(master, "-H") == f"http://sim:{_value(sim, '--port')}"
    for _, target in targets.values():
        assert target.split(":")[0] in SERVICES
    assert "master" in prom["depends_on"] and "sim" in prom["depends_on"]


def test_grafana_is_provisioned_with_the_datasource_and_the_dashboard() -> None:
    grafana = SERVICES["grafana"]
    mounts = _mounts(grafana)
    assert mounts["/etc/grafana/provisioning"] == PROVISIONING
    (ds_file,) = (PROVISIONING / "datasources").glob("*.yml")
    (datasource,) = yaml.safe_load(ds_file.read_text())["datasources"]
    assert datasource["type"] == "prometheus"
    assert datasource["url"] == "http://prometheus:9090"
    assert "9090:9090" in SERVICES["prometheus"]["ports"]
    (provider,) = yaml.safe_load((PROVISIONING / "dashboards" / "calculet.yml").read_text())[
        "providers"
    ]
    dash_in_container = next(c for c, h in mounts.items() if h == dash_mod.DASHBOARD)
    assert str(Path(dash_in_container).parent) == provider["options"]["path"]
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == dash_in_container
    # every panel and variable of the dashboard uses the provisioned datasource
    dash = dash_mod.load()
    refs = [p["datasource"] for p in dash_mod.panels(dash) if "datasource" in p]
    refs += [t["datasource"] for p in dash_mod.panels(dash) for t in p.get("targets", [])]
    refs += [v["datasource"] for v in dash["templating"]["list"]]
    assert refs and all(r == {"type": "prometheus", "uid": datasource["uid"]} for r in refs)


def test_the_dashboard_is_a_well_formed_grafana_model() -> None:
    dash = dash_mod.load()
    assert dash["uid"] and dash["title"] and isinstance(dash["schemaVersion"], int)
    assert dash["schemaVersion"] >= 36
    all_panels = list(dash_mod.panels(dash))
    ids = [p["id"] for p in all_panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    rows = [p["title"] for p in all_panels if p["type"] == "row"]
    assert [r.split(" ")[0] for r in rows] == ["Request", "Runtime", "System"], rows
    known = {"row", "timeseries", "heatmap", "text", "stat", "bargauge"}
    cells: set[tuple[int, int]] = set()
    for p in all_panels:
        assert p["type"] in known, p["type"]
        g = p["gridPos"]
        assert {"h", "w", "x", "y"} <= set(g) and g["x"] + g["w"] <= 24, p["title"]
        mine = {(g["x"] + i, g["y"] + j) for i in range(g["w"]) for j in range(g["h"])}
        assert not mine & cells, f"{p['title']} overlaps another panel"
        cells |= mine
        if p["type"] in ("row", "text"):
            continue
        refs = [t["refId"] for t in p["targets"]]
        assert refs and len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            expr = t["expr"]
            assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}")
            assert dash_mod.metric_names(expr), (p["title"], expr)
    # each panel sits under the row of its section: client series under Request,
    # process and chip series under System/device
    row_ys = sorted(
        (p["gridPos"]["y"], p["title"].split(" ")[0]) for p in all_panels if p["type"] == "row"
    )
    for p in all_panels:
        if p["type"] in ("row", "text"):
            continue
        section = [name for y, name in row_ys if y <= p["gridPos"]["y"]][-1]
        read = {n for t in p["targets"] for n in dash_mod.metric_names(t["expr"])}
        if any(n.startswith(("calculet_chip_", "calculet_process_")) for n in read):
            assert section == "System", p["title"]
        if any(n.startswith("calculet_client_") for n in read):
            assert section == "Request", p["title"]
    names = dash_mod.referenced_series(dash)
    assert any(n.startswith("calculet_client_") for n in names)
    assert any(n.startswith("calculet_chip_") for n in names)


def test_the_promql_name_extractor_cannot_be_fooled() -> None:
    f = dash_mod.metric_names
    assert f('sum by (le, phase) (rate(a_bucket{x="y(z)"}[$__rate_interval]))') == {"a_bucket"}
    assert f("histogram_quantile(0.99, b) / 1e3 + c == 1") == {"b", "c"}
    assert f("label_values(calculet_client_requests_total, model)") == {
        "calculet_client_requests_total"
    }
    with pytest.raises(ValueError, match="rat"):
        f("rat(x[5m])")


def test_promtool_accepts_the_prometheus_config(tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip(
            "promtool is not installed (Debian's `prometheus` package is ~100 MB; not "
            "installed for one check); the config is checked as data above"
        )
    out = subprocess.run(
        [promtool, "check", "config", str(PROMETHEUS_YML)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stdout + out.stderr
