// loopd's status page: reads GET /v1/status every two seconds and draws it. Plain DOM, no
// library; every value from the document goes in as text (textContent), never as markup,
// since session ids and agent names come from the agents' own headers.
"use strict";

(function () {
  const POLL_MS = 2000;
  const DASH = "\u2013";

  // -- formatting --------------------------------------------------------------------------

  function num(value) {
    return value === null || value === undefined ? DASH : Number(value).toLocaleString("en-US");
  }

  function pct(share) {
    return share === null || share === undefined ? DASH : (share * 100).toFixed(1) + " %";
  }

  function secs(value) {
    if (value === null || value === undefined) return DASH;
    if (value < 1) return Math.round(value * 1000) + " ms";
    if (value < 60) return value.toFixed(2) + " s";
    const minutes = Math.floor(value / 60);
    if (minutes < 60) return minutes + " min " + Math.round(value % 60) + " s";
    return Math.floor(minutes / 60) + " h " + (minutes % 60) + " min";
  }

  function ago(when, now) {
    if (!when) return DASH;
    const seconds = Math.max(0, now - when);
    if (seconds < 60) return Math.round(seconds) + " s ago";
    if (seconds < 3600) return Math.round(seconds / 60) + " min ago";
    return (seconds / 3600).toFixed(1) + " h ago";
  }

  function clock(when) {
    return when ? new Date(when * 1000).toLocaleTimeString("en-GB") : DASH;
  }

  function text(value) {
    return value === null || value === undefined || value === "" ? DASH : String(value);
  }

  // -- building the DOM --------------------------------------------------------------------

  function element(tag, content, className) {
    const node = document.createElement(tag);
    if (content !== undefined && content !== null) node.textContent = content;
    if (className) node.className = className;
    return node;
  }

  // A table cell: {text, field, value, num, cls}. `field` names the document's field (for
  // tests and scripts), `value` keeps the raw number behind a formatted one.
  function cell(spec) {
    const td = element("td", spec.text);
    const classes = [];
    if (spec.num) classes.push("num");
    if (spec.cls) classes.push(spec.cls);
    if (classes.length) td.className = classes.join(" ");
    if (spec.field) td.dataset.field = spec.field;
    if (spec.value !== undefined && spec.value !== null) td.dataset.value = String(spec.value);
    return td;
  }

  function row(cells) {
    const tr = document.createElement("tr");
    cells.forEach(function (spec) { tr.appendChild(cell(spec)); });
    return tr;
  }

  function fill(tableId, rows) {
    const table = document.getElementById(tableId);
    table.tBodies[0].replaceChildren.apply(table.tBodies[0], rows);
    table.hidden = rows.length === 0;
    const empty = document.querySelector('[data-empty-for="' + tableId + '"]');
    if (empty) empty.hidden = rows.length !== 0;
  }

  // -- the sections --------------------------------------------------------------------------

  function renderHeader(doc) {
    const loopd = doc.loopd;
    document.getElementById("version").textContent =
      "v" + loopd.version + " \u00b7 up " + secs(loopd.now - loopd.started);
    document.getElementById("clock").textContent = "updated " + clock(loopd.now);
  }

  function renderTotals(doc) {
    const totals = doc.totals;
    const figures = [
      ["requests", num(totals.requests), "requests"],
      ["under way", num(doc.in_flight.length), "in_flight"],
      ["mesh turns", num(doc.mesh_turns), "mesh_turns"],
      ["prompt tokens reused", num(totals.reused_tokens), "reused_tokens"],
      ["prompt tokens evaluated", num(totals.evaluated_tokens), "evaluated_tokens"],
      ["tokens generated", num(totals.generated_tokens), "generated_tokens"],
      ["cache reuse", pct(totals.reuse), "reuse"],
      ["prefill time saved", secs(totals.saved_seconds), "saved_seconds"],
      ["thinking capped", num(totals.thinking_capped), "thinking_capped"],
      ["errors", num(totals.errors), "errors"],
    ];
    const list = document.getElementById("totals");
    list.replaceChildren.apply(list, figures.map(function (figure) {
      const box = document.createElement("div");
      box.dataset.field = figure[2];
      box.appendChild(element("dt", figure[0]));
      box.appendChild(element("dd", figure[1]));
      return box;
    }));
  }

  function renderEndpoints(doc) {
    const holder = document.getElementById("endpoints");
    holder.replaceChildren.apply(holder, doc.endpoints.map(function (endpoint) {
      const card = element("div", null, "card");
      card.dataset.endpoint = endpoint.name;
      card.appendChild(element("h3", endpoint.name));
      const what = element("p", null, "muted");
      what.textContent = endpoint.model + " \u00b7 " + endpoint.kind;
      card.appendChild(what);
      const health = element("p");
      health.appendChild(element("span", endpoint.health, "health " + endpoint.health));
      if (endpoint.why) health.appendChild(document.createTextNode(" \u2014 " + endpoint.why));
      card.appendChild(health);
      card.appendChild(element("p",
        "prompt " + num(endpoint.prompt_tokens_per_second) + " tokens/s \u00b7 generation " +
        num(endpoint.generation_tokens_per_second) + " tokens/s", "muted"));
      const table = document.createElement("table");
      const head = table.createTHead().insertRow();
      ["slot", "state", "session", "tokens cached"].forEach(function (name, index) {
        const th = element("th", name);
        if (index === 0 || index === 3) th.className = "num";
        head.appendChild(th);
      });
      const body = table.createTBody();
      endpoint.slots.forEach(function (slot) {
        const tr = row([
          { text: String(slot.id), num: true, field: "id" },
          { text: slot.state, field: "state", cls: "slot-" + slot.state },
          { text: text(slot.session), field: "session", cls: "session" },
          { text: num(slot.tokens_cached), num: true, field: "tokens_cached", value: slot.tokens_cached },
        ]);
        tr.dataset.slot = String(slot.id);
        body.appendChild(tr);
      });
      card.appendChild(table);
      return card;
    }));
  }

  function renderSessions(doc) {
    const now = doc.loopd.now;
    fill("sessions", doc.sessions.map(function (s) {
      const tr = row([
        { text: s.id, field: "id", cls: "session" },
        { text: s.agent || (s.anonymous ? "(anonymous)" : DASH), field: "agent" },
        { text: num(s.turns), num: true, field: "turns", value: s.turns },
        { text: num(s.reused_tokens), num: true, field: "reused_tokens", value: s.reused_tokens },
        { text: num(s.evaluated_tokens), num: true, field: "evaluated_tokens", value: s.evaluated_tokens },
        { text: num(s.generated_tokens), num: true, field: "generated_tokens", value: s.generated_tokens },
        { text: pct(s.reuse), num: true, field: "reuse", value: s.reuse },
        { text: secs(s.saved_seconds), num: true, field: "saved_seconds", value: s.saved_seconds },
        { text: num(s.thinking_capped), num: true, field: "thinking_capped", value: s.thinking_capped },
        { text: num(s.errors), num: true, field: "errors", value: s.errors, cls: s.errors ? "outcome-bad" : "" },
        { text: ago(s.last_seen, now), field: "last_seen", value: s.last_seen },
        { text: text(s.home), field: "home" },
      ]);
      tr.dataset.session = s.id;
      return tr;
    }));
  }

  function describeCall(call) {
    let where = call.endpoint + (call.slot === null ? "" : " slot " + call.slot);
    const how = [call.role];
    if (call.waiting_for_lease) how.push("waiting for its lease");
    if (call.ended) how.push("ended");
    return where + " (" + how.join(", ") + ")";
  }

  function renderInFlight(doc) {
    document.getElementById("mesh-turns").textContent =
      doc.mesh_turns ? doc.mesh_turns + " mesh turn(s) under way" : "";
    fill("in-flight", doc.in_flight.map(function (r) {
      return row([
        { text: String(r.id), num: true, field: "id" },
        { text: r.door, field: "door" },
        { text: text(r.session), field: "session", cls: "session" },
        { text: text(r.agent), field: "agent" },
        { text: text(r.model) + (r.mesh ? " (mesh)" : ""), field: "model" },
        { text: secs(r.seconds), num: true, field: "seconds", value: r.seconds },
        { text: r.calls.map(describeCall).join("; ") || DASH, field: "calls" },
      ]);
    }));
  }

  function who(entries) {
    return entries.map(function (entry) {
      const how = [];
      if (entry.role && entry.role !== "parent") how.push(entry.role);
      if (entry.group) how.push("group " + entry.group);
      return entry.sessionKey + (how.length ? " (" + how.join(", ") + ")" : "");
    }).join(", ") || DASH;
  }

  function renderLeases(doc) {
    const queues = doc.leases || [];
    fill("leases", queues.map(function (q) {
      return row([
        { text: q.queueKey, field: "queueKey" },
        { text: q.maxStreams === null ? "passthrough" : String(q.maxStreams), num: true, field: "maxStreams" },
        { text: num(q.switches), num: true, field: "switches" },
        { text: who(q.holders), field: "holders" },
        { text: who(q.waiting), field: "waiting" },
      ]);
    }));
    const empty = document.querySelector('[data-empty-for="leases"]');
    empty.textContent = doc.leases === null ? "Leases are off." : "No lease queue yet.";
  }

  function notes(r) {
    const said = [];
    if (r.calls > 1) said.push(r.calls + " calls");
    if (r.retries) said.push(r.retries + (r.retries === 1 ? " retry" : " retries"));
    if (r.thinking_capped) said.push("thinking capped");
    return said.join(" \u00b7 ") || DASH;
  }

  function renderRequests(doc) {
    fill("requests", doc.requests.map(function (r) {
      const bad = r.outcome !== "ok";
      return row([
        { text: String(r.id), num: true, field: "id" },
        { text: clock(r.started), field: "started" },
        { text: r.door + (r.stream ? " (stream)" : ""), field: "door" },
        { text: text(r.session), field: "session", cls: "session" },
        { text: text(r.agent), field: "agent" },
        { text: text(r.model) + (r.mesh ? " (mesh)" : ""), field: "model" },
        { text: text(r.endpoint), field: "endpoint" },
        { text: text(r.status), num: true, field: "status" },
        { text: text(r.outcome), field: "outcome", cls: bad ? "outcome-bad" : "" },
        { text: num(r.reused_tokens), num: true, field: "reused_tokens", value: r.reused_tokens },
        { text: num(r.evaluated_tokens), num: true, field: "evaluated_tokens", value: r.evaluated_tokens },
        { text: num(r.generated_tokens), num: true, field: "generated_tokens", value: r.generated_tokens },
        { text: secs(r.lease_wait_seconds), num: true, field: "lease_wait_seconds" },
        { text: secs(r.first_token_seconds), num: true, field: "first_token_seconds" },
        { text: secs(r.seconds), num: true, field: "seconds" },
        { text: notes(r), field: "notes" },
        { text: text(r.error), field: "error", cls: "error" },
      ]);
    }));
  }

  // -- the plot --------------------------------------------------------------------------

  function niceMax(value) {
    if (!(value > 0)) return 1;
    const power = Math.pow(10, Math.floor(Math.log10(value)));
    const steps = [1, 2, 2.5, 5, 10];
    for (let i = 0; i < steps.length; i++) {
      if (value <= steps[i] * power) return steps[i] * power;
    }
    return 10 * power;
  }

  function drawPlot(series) {
    const canvas = document.getElementById("plot");
    const ratio = window.devicePixelRatio || 1;
    const width = canvas.clientWidth || canvas.width;
    const height = canvas.clientHeight || canvas.height;
    canvas.width = Math.round(width * ratio);
    canvas.height = Math.round(height * ratio);
    const ctx = canvas.getContext("2d");
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    ctx.clearRect(0, 0, width, height);

    const style = getComputedStyle(document.documentElement);
    const colour = function (name) { return style.getPropertyValue(name).trim(); };
    const rates = series.tokens_per_second;
    const reuse = series.reuse;
    const n = rates.length;
    const left = 52, right = 48, top = 14, bottom = 28;
    const plotWidth = width - left - right;
    const plotHeight = height - top - bottom;
    const top_rate = niceMax(Math.max.apply(null, rates.concat([0])));
    const x = function (i) { return left + (n > 1 ? (i / (n - 1)) * plotWidth : plotWidth); };
    const yRate = function (v) { return top + plotHeight - (v / top_rate) * plotHeight; };
    const yReuse = function (v) { return top + plotHeight - v * plotHeight; };

    ctx.font = "11px system-ui, sans-serif";
    ctx.lineWidth = 1;
    ctx.strokeStyle = colour("--line");
    ctx.fillStyle = colour("--muted");
    for (let g = 0; g <= 4; g++) {
      const y = top + (g / 4) * plotHeight;
      ctx.beginPath();
      ctx.moveTo(left, y + 0.5);
      ctx.lineTo(left + plotWidth, y + 0.5);
      ctx.stroke();
      ctx.textAlign = "right";
      ctx.fillText(String(+(top_rate * (1 - g / 4)).toPrecision(3)), left - 6, y + 4);
      ctx.textAlign = "left";
      ctx.fillText(Math.round(100 * (1 - g / 4)) + "%", left + plotWidth + 6, y + 4);
    }
    // The time axis: the clock time of every fifteenth minute back from the last one.
    ctx.textAlign = "center";
    const starts = series.minute_starts;
    for (let i = n - 1; i >= 0; i -= 15) {
      const label = new Date(starts[i] * 1000).toLocaleTimeString("en-GB",
        { hour: "2-digit", minute: "2-digit" });
      ctx.fillText(label, Math.min(Math.max(x(i), left + 16), left + plotWidth - 16), height - 8);
    }

    // Tokens per second: a filled line.
    ctx.strokeStyle = colour("--rate");
    ctx.fillStyle = colour("--rate");
    ctx.lineWidth = 2;
    ctx.beginPath();
    for (let i = 0; i < n; i++) {
      if (i === 0) ctx.moveTo(x(i), yRate(rates[i]));
      else ctx.lineTo(x(i), yRate(rates[i]));
    }
    ctx.stroke();
    ctx.globalAlpha = 0.12;
    ctx.lineTo(x(n - 1), yRate(0));
    ctx.lineTo(x(0), yRate(0));
    ctx.closePath();
    ctx.fill();
    ctx.globalAlpha = 1;

    // Cache reuse: a line through the minutes that had prompts, a dot on each.
    ctx.strokeStyle = colour("--reuse");
    ctx.fillStyle = colour("--reuse");
    ctx.beginPath();
    let drawing = false;
    for (let i = 0; i < n; i++) {
      if (reuse[i] === null) { drawing = false; continue; }
      if (drawing) ctx.lineTo(x(i), yReuse(reuse[i]));
      else ctx.moveTo(x(i), yReuse(reuse[i]));
      drawing = true;
    }
    ctx.stroke();
    for (let i = 0; i < n; i++) {
      if (reuse[i] === null) continue;
      ctx.beginPath();
      ctx.arc(x(i), yReuse(reuse[i]), 3, 0, 2 * Math.PI);
      ctx.fill();
    }
    canvas.dataset.points = String(n);
  }

  // -- polling ---------------------------------------------------------------------------

  function setState(state, label, notice) {
    document.body.dataset.state = state;
    document.getElementById("state").textContent = label;
    const box = document.getElementById("notice");
    box.textContent = notice || "";
    box.hidden = !notice;
  }

  function render(doc) {
    renderHeader(doc);
    renderTotals(doc);
    drawPlot(doc.series);
    renderEndpoints(doc);
    renderSessions(doc);
    renderInFlight(doc);
    renderLeases(doc);
    renderRequests(doc);
    setState("live", "live");
    document.body.dataset.updated = String(doc.loopd.now);
  }

  function poll() {
    fetch("/v1/status", {
      headers: { Accept: "application/json" },
      credentials: "same-origin",
      cache: "no-store",
    })
      .then(function (response) {
        if (response.status === 401) {
          setState("signed-out", "signed out",
            "This browser is no longer signed in (the sign-in ends after twelve hours " +
            "without use, or when loopd restarts). Run loopd ui for a new login link.");
          return;
        }
        if (!response.ok) throw new Error("GET /v1/status answered " + response.status);
        return response.json().then(function (doc) {
          render(doc);
          window.setTimeout(poll, POLL_MS);
        });
      })
      .catch(function (error) {
        setState("lost", "not answering", "loopd did not answer: " + error.message +
          ". Trying again every few seconds.");
        window.setTimeout(poll, POLL_MS);
      });
  }

  poll();
})();
