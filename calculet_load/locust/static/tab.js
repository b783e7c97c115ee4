/* calculet-load: the "LLM (calculet)" tab of Locust's web UI, and its Edit dialog.
 *
 * Locust's stock bundle gives an extended tab a table only, filled while a run goes on.
 * This script (loaded after the bundle: calculet_load/locust/webui.py) puts a panel in
 * its place: controls that set the open loop's rate and fire a burst, live charts of the
 * run's series (uPlot, vendored beside it), and the same figures table, polled from
 * /calculet/live in every state so that it keeps the last run's figures after Stop.
 * In Locust's Edit dialog it greys out the custom parameters a running run cannot
 * change (the server refuses them anyway, with a message).
 */
(function () {
  "use strict";

  var POLL_MS = 2000;
  var KEEP = 3600; // points kept in the page, as the master keeps them
  var CHART_HEIGHT = 210;
  var RUNNING = ["spawning", "running"];
  var CHARTS = [
    { id: "ttft", title: "TTFT ms (p50, p99 over the last 10 s)",
      series: [["ttft_p50_ms", "p50", "#1976d2"], ["ttft_p99_ms", "p99", "#d32f2f"]] },
    { id: "tpot", title: "TPOT ms (p50, p99 over the last 10 s)",
      series: [["tpot_p50_ms", "p50", "#1976d2"], ["tpot_p99_ms", "p99", "#d32f2f"]] },
    { id: "itl", title: "ITL ms per token (p50, p99 over the last 10 s)",
      series: [["itl_p50_ms", "p50", "#1976d2"], ["itl_p99_ms", "p99", "#d32f2f"]] },
    { id: "load", title: "output tokens/s (left) and requests in flight (right)",
      series: [["output_tokens_per_s", "output tokens/s", "#2e7d32", "y"],
               ["in_flight", "in flight", "#ef6c00", "n"]] },
  ];
  var MARK_COLOURS = { rate: "#c2185b", burst: "#6a1b9a" };

  var S = { key: null, seq: 0, points: [], marks: [], run: null, state: null };
  var panel = null;
  var plots = {};
  var timer = null;

  function el(tag, attrs, children) {
    var e = document.createElement(tag);
    Object.keys(attrs || {}).forEach(function (k) {
      if (k === "text") e.textContent = attrs[k];
      else e.setAttribute(k, attrs[k]);
    });
    (children || []).forEach(function (c) { e.appendChild(c); });
    return e;
  }

  function camel(name) {
    return name.replace(/_([a-z0-9])/g, function (_, c) { return c.toUpperCase(); });
  }

  function fmt(v) {
    if (v === null || v === undefined) return "no data";
    return Math.abs(v) < 100 ? String(Number(v.toPrecision(3))) : String(Math.round(v));
  }

  // ---------------------------------------------------------------- the panel
  function build() {
    var rate = el("input", { id: "calculet-rate", inputmode: "decimal", size: "8",
                             "aria-label": "arrivals per second, all workers" });
    var size = el("input", { id: "calculet-burst-size", inputmode: "numeric", size: "6",
                             "aria-label": "requests in the burst" });
    var rateForm = el("form", { id: "calculet-rate-form", class: "calculet-control" }, [
      el("label", { for: "calculet-rate", text: "Rate (arrivals/s, all workers)" }), rate,
      el("button", { type: "submit", id: "calculet-set-rate", text: "Set rate" }),
      el("span", { id: "calculet-rate-hint", class: "calculet-hint" }),
    ]);
    var burstForm = el("form", { id: "calculet-burst-form", class: "calculet-control" }, [
      el("label", { for: "calculet-burst-size", text: "Burst of" }), size,
      el("span", { text: "requests" }),
      el("button", { type: "submit", id: "calculet-fire-burst", text: "Fire burst now" }),
      el("span", { id: "calculet-burst-hint", class: "calculet-hint" }),
    ]);
    rateForm.addEventListener("submit", function (ev) {
      ev.preventDefault();
      post("./calculet/rate", { rate: rate.value.trim() }, function (d) {
        return "rate " + d.rate + "/s from 0.5 s ahead, on every worker";
      });
    });
    burstForm.addEventListener("submit", function (ev) {
      ev.preventDefault();
      post("./calculet/burst", { size: size.value.trim() }, function (d) {
        return "burst " + d.id + " fires at " + new Date(d.fire_at_wall_ns / 1e6).toLocaleTimeString();
      });
    });
    var charts = el("div", { class: "calculet-charts" });
    CHARTS.forEach(function (c) {
      charts.appendChild(el("div", { class: "calculet-chart", id: "calculet-chart-" + c.id,
                                     "data-points": "0", "data-marks": "0" }));
    });
    return el("div", { id: "calculet-panel" }, [
      el("div", { class: "calculet-controls" }, [
        rateForm, burstForm,
        el("div", { id: "calculet-message", role: "status" }),
      ]),
      el("div", { id: "calculet-status", class: "calculet-hint" }),
      charts,
      el("table", { id: "calculet-figures" }, [el("thead"), el("tbody")]),
    ]);
  }

  function post(url, body, said) {
    var msg = document.getElementById("calculet-message");
    msg.className = "";
    msg.textContent = "…";
    fetch(url, { method: "POST", headers: { "Content-Type": "application/json" },
                 body: JSON.stringify(body) })
      .then(function (r) {
        return r.json().then(function (d) { return { ok: r.ok, d: d }; });
      })
      .then(function (a) {
        msg.className = a.ok ? "calculet-ok" : "calculet-error";
        msg.textContent = a.ok ? said(a.d) : (a.d && a.d.error) || "refused";
        if (a.ok) poll(true);
      })
      .catch(function (e) {
        msg.className = "calculet-error";
        msg.textContent = "cannot reach the Locust master: " + e;
      });
  }

  function stockTable() {
    var heads = document.querySelectorAll("table thead th");
    for (var i = 0; i < heads.length; i++) {
      var th = heads[i];
      if (th.textContent.trim() === "Figure" && !th.closest("#calculet-panel")) {
        return th.closest("table");
      }
    }
    return null;
  }

  function place() {
    var table = stockTable();
    if (!table) {
      if (panel && panel.isConnected) panel.remove(); // the tab was left
      return;
    }
    var box = table.closest(".MuiTableContainer-root") || table;
    if (panel && panel.isConnected && panel.nextSibling === box) return;
    if (!panel) panel = build();
    box.parentNode.insertBefore(panel, box);
    box.style.display = "none"; // the panel's own table replaces it, in every state
    if (!Object.keys(plots).length) makeCharts();
    resize();
    poll(true);
  }

  // ---------------------------------------------------------------- polling
  function poll(now) {
    if (timer) clearTimeout(timer);
    timer = null;
    if (!panel || !panel.isConnected) return;
    if (!now) { timer = setTimeout(function () { poll(true); }, POLL_MS); return; }
    fetch("./calculet/live?since=" + S.seq)
      .then(function (r) { return r.json(); })
      .then(function (d) { update(d); })
      .catch(function () {
        document.getElementById("calculet-status").textContent =
          "cannot reach the Locust master; trying again";
      })
      .then(function () { poll(false); });
  }

  function update(d) {
    var run = d.run;
    var key = run ? run.run_id + "@" + run.started_wall_ns : null;
    if (key !== S.key || (d.seq !== undefined && d.seq < S.seq)) {
      var first = S.key === null;
      S.key = key; S.seq = 0; S.points = []; S.marks = [];
      if (!first && d.seq) { poll(true); return; } // the series of the new run from its start
    }
    S.run = run; S.state = d.state;
    follow("calculet-rate", run && run.rate);
    follow("calculet-burst-size", run && run.burst_size);
    (d.series || []).forEach(function (p) { S.points.push(p); S.seq = Math.max(S.seq, p.seq); });
    if (S.points.length > KEEP) S.points.splice(0, S.points.length - KEEP);
    S.marks = d.marks || [];
    controls();
    table(d.columns || [], d.rows || []);
    draw();
  }

  // An input shows the run's value (a rate an Edit or another page set), unless a
  // person is typing in it.
  function follow(id, value) {
    var input = document.getElementById(id);
    if (value === null || value === undefined || document.activeElement === input) return;
    if (input.getAttribute("data-run-value") !== String(value)) {
      input.value = value;
      input.setAttribute("data-run-value", String(value));
    }
  }

  function controls() {
    var run = S.run, going = RUNNING.indexOf(S.state) >= 0 && run && run.ended_wall_ns === null;
    var rateOk = going && run.live_options.indexOf("rate") >= 0;
    var status = run
      ? "run " + run.run_id + " · " + run.arrival + (run.rate !== null ? " at " + fmt(run.rate) + "/s" : "") +
        " · " + S.state + " · " + S.points.length + " points"
      : "no run yet";
    document.getElementById("calculet-status").textContent = status;
    ["calculet-rate", "calculet-set-rate"].forEach(function (id) {
      document.getElementById(id).disabled = !rateOk;
    });
    ["calculet-burst-size", "calculet-fire-burst"].forEach(function (id) {
      document.getElementById(id).disabled = !going;
    });
    document.getElementById("calculet-rate-hint").textContent = rateOk ? "" :
      !going ? "(while a run goes on)" : "(open-loop runs only: this run is " + run.arrival + ")";
    document.getElementById("calculet-burst-hint").textContent = going ? "" : "(while a run goes on)";
  }

  function table(columns, rows) {
    var t = document.getElementById("calculet-figures");
    var head = t.tHead, body = t.tBodies[0];
    if (head.rows.length === 0 && columns.length) {
      var tr = head.insertRow();
      columns.forEach(function (c) { tr.appendChild(el("th", { text: c.title })); });
    }
    var keys = columns.map(function (c) { return c.key; });
    while (body.rows.length > rows.length) body.deleteRow(-1);
    rows.forEach(function (row, i) {
      var r = body.rows[i] || body.insertRow();
      keys.forEach(function (k, j) {
        var cell = r.cells[j] || r.insertCell();
        var text = row[k] === undefined || row[k] === null ? "" : String(row[k]);
        if (cell.textContent !== text) cell.textContent = text;
      });
    });
  }

  // ---------------------------------------------------------------- charts
  function marksPlugin() {
    return { hooks: { draw: [function (u) {
      var ctx = u.ctx, b = u.bbox, px = window.devicePixelRatio || 1;
      var shown = 0;
      ctx.save();
      ctx.setLineDash([5 * px, 4 * px]);
      ctx.lineWidth = px;
      ctx.font = Math.round(10 * px) + "px sans-serif";
      S.marks.forEach(function (m, i) {
        var x = Math.round(u.valToPos(m.wall_ns / 1e9, "x", true));
        if (x < b.left || x > b.left + b.width) return;
        shown += 1;
        ctx.strokeStyle = ctx.fillStyle = MARK_COLOURS[m.kind] || "#555";
        ctx.beginPath(); ctx.moveTo(x, b.top); ctx.lineTo(x, b.top + b.height); ctx.stroke();
        ctx.fillText(m.label, x + 3 * px, b.top + (12 + 11 * (i % 3)) * px);
      });
      ctx.restore();
      u.root.parentNode.setAttribute("data-marks", String(shown));
    }] } };
  }

  function makeCharts() {
    var fg = getComputedStyle(panel).color || "#222";
    var grid = { stroke: "rgba(128,128,128,0.25)", width: 1 };
    CHARTS.forEach(function (c) {
      var twoScales = c.series.some(function (s) { return s[3] === "n"; });
      var axes = [{ stroke: fg, grid: grid }, { stroke: fg, grid: grid, size: 56 }];
      if (twoScales) axes.push({ scale: "n", side: 1, stroke: fg, grid: { show: false }, size: 44 });
      var opts = {
        title: c.title,
        width: 600,
        height: CHART_HEIGHT,
        scales: { x: { time: true }, n: { range: function (u, lo, hi) { return [0, Math.max(hi, 1)]; } } },
        series: [{}].concat(c.series.map(function (s) {
          return { label: s[1], stroke: s[2], width: 1.5, scale: s[3] || "y",
                   value: function (u, v) { return v === null || v === undefined ? "" : fmt(v); } };
        })),
        axes: axes,
        plugins: [marksPlugin()],
      };
      plots[c.id] = new uPlot(opts, data(c), document.getElementById("calculet-chart-" + c.id));
    });
    window.addEventListener("resize", resize);
  }

  function data(c) {
    var xs = S.points.map(function (p) { return p.wall_ns / 1e9; });
    return [xs].concat(c.series.map(function (s) {
      return S.points.map(function (p) { return p[s[0]] === undefined ? null : p[s[0]]; });
    }));
  }

  function draw() {
    CHARTS.forEach(function (c) {
      var u = plots[c.id];
      if (!u) return;
      u.setData(data(c));
      document.getElementById("calculet-chart-" + c.id).setAttribute("data-points", String(S.points.length));
    });
  }

  function resize() {
    var wrap = panel && panel.querySelector(".calculet-charts");
    if (!wrap) return;
    var w = Math.max(Math.floor((wrap.clientWidth - 24) / 2), 300);
    CHARTS.forEach(function (c) {
      if (plots[c.id]) plots[c.id].setSize({ width: w, height: CHART_HEIGHT });
    });
  }

  // ---------------------------------------------------------------- Locust's Edit dialog
  function editDialog() {
    var heads = document.querySelectorAll("h2");
    for (var i = 0; i < heads.length; i++) {
      if (heads[i].textContent.trim() !== "Edit running load test") continue;
      var form = heads[i].parentElement && heads[i].parentElement.querySelector("form");
      if (!form || form.getAttribute("data-calculet")) continue;
      form.setAttribute("data-calculet", "pending");
      fetch("./calculet/live")
        .then(function (r) { return r.json(); })
        .then(function (d) { fixFields(form, d.run); })
        .catch(function () { form.removeAttribute("data-calculet"); });
    }
  }

  function fixFields(form, run) {
    if (!run) { form.removeAttribute("data-calculet"); return; }
    var fixed = {}, values = {};
    run.fixed_options.forEach(function (n) { fixed[camel(n)] = true; });
    Object.keys(run.values || {}).forEach(function (n) { values[camel(n)] = run.values[n]; });
    var fields = form.querySelectorAll("input, select, textarea");
    var first = null;
    for (var i = 0; i < fields.length; i++) {
      var f = fields[i];
      if (Object.prototype.hasOwnProperty.call(values, f.name)) show(f, values[f.name]);
      if (!fixed[f.name]) continue;
      var box = f.closest(".MuiFormControl-root, .MuiFormControlLabel-root") || f.parentElement;
      f.readOnly = true;
      if (f.type === "checkbox" || f.type === "text" || f.type === "number") f.disabled = true;
      box.classList.add("calculet-fixed");
      box.setAttribute("title", "fixed while this run goes on");
      var combo = box.querySelector("[role=combobox]");
      if (combo) { combo.setAttribute("aria-disabled", "true"); combo.tabIndex = -1; }
      if (!first) first = box;
    }
    var live = run.live_options.map(function (n) { return "--" + n.replace(/_/g, "-"); });
    var note = el("p", { class: "calculet-edit-note", id: "calculet-edit-note",
      text: "calculet-load: while the run goes on, Edit changes " +
            (live.length ? live.join(", ") : "none of calculet's parameters") +
            " at once; the greyed-out parameters are fixed until the next start." });
    if (first && first.parentNode) first.parentNode.insertBefore(note, first.parentNode.firstChild);
    else form.insertBefore(note, form.firstChild);
    form.setAttribute("data-calculet", "done");
  }

  // The dialog's fields show what the form last sent (or the command line's values, in a
  // page opened before the run started elsewhere): set them to the run's own, so that an
  // Edit of the user count sends the run's rate back, not an older one.
  function show(f, v) {
    if (f.type === "checkbox") { f.checked = !!v; return; }
    var text = v === null || v === undefined ? "" : String(v);
    if (f.value === text) return;
    f.value = text;
    var combo = f.parentElement && f.parentElement.querySelector("[role=combobox]");
    if (combo) combo.textContent = text; // a select's shown choice
  }

  // ---------------------------------------------------------------- wiring
  var pending = false;
  new MutationObserver(function () {
    if (pending) return;
    pending = true;
    window.requestAnimationFrame(function () { pending = false; place(); editDialog(); });
  }).observe(document.body, { childList: true, subtree: true });
})();
