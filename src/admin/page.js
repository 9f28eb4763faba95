"use strict";
// a token from the URL's fragment (#token=…) or asked once, kept for the tab
let token = sessionStorage.getItem("rls-token") || "";
const fragment = new URLSearchParams(location.hash.slice(1));
if (fragment.get("token")) { token = fragment.get("token"); sessionStorage.setItem("rls-token", token); }

async function get(path) {
  const headers = token ? { Authorization: "Bearer " + token } : {};
  const r = await fetch(path, { headers });
  if (r.status === 401) {
    token = prompt("Admin token (--admin-token-file)") || "";
    sessionStorage.setItem("rls-token", token);
    throw new Error("a token is needed");
  }
  if (!r.ok) throw new Error(path + ": " + r.status);
  return r.json();
}

function cell(row, text, cls) {
  const td = document.createElement("td");
  td.textContent = text;
  if (cls) td.className = cls;
  row.appendChild(td);
}

function table(headings, rows) {
  const t = document.createElement("table");
  const head = t.createTHead().insertRow();
  for (const h of headings) { const th = document.createElement("th"); th.textContent = h; head.appendChild(th); }
  const body = t.createTBody();
  for (const r of rows) {
    const tr = body.insertRow();
    r.forEach((v, i) => cell(tr, v, typeof v === "number" ? "n" : (i === 2 ? "" : "")));
  }
  return t;
}

function hitters(target, rules, kind) {
  const out = document.getElementById(target);
  out.replaceChildren();
  const rows = [];
  for (const r of rules) {
    const top = r[kind];
    for (const h of top.minute) {
      const hour = top.hour.find(x => x.value === h.value);
      rows.push([r.domain, r.rule, h.value, h.count, hour ? hour.count : 0, h.error]);
    }
  }
  rows.sort((a, b) => b[3] - a[3]);
  if (rows.length === 0) {
    out.textContent = kind === "refused" ? "Nobody refused in the last minute." : "No decisions in the last minute.";
    out.className = "muted";
    return;
  }
  out.className = "";
  out.appendChild(table(["domain", "rule", "descriptor", "last minute", "last hour", "± at most"], rows.slice(0, 50)));
}

let before = null;
async function refresh() {
  try {
    const [h, rules, store, rlqs, regions] = await Promise.all(
      [get("v1/hitters?n=10"), get("v1/rules"), get("v1/store"), get("v1/rlqs"), get("v1/regions")]);
    const now = Date.now();
    hitters("refused", h.rules, "refused");
    hitters("admitted", h.rules, "admitted");

    const body = document.querySelector("#rules tbody");
    body.replaceChildren();
    for (const r of rules.rules) {
      const key = r.domain + "\u0000" + r.rule;
      const last = before && before.rules.get(key);
      const secs = before ? (now - before.at) / 1000 : 0;
      const rate = (x, y) => (last && secs > 0 ? ((x - y) / secs).toFixed(1) : "–");
      const tr = body.insertRow();
      cell(tr, r.domain); cell(tr, r.rule);
      cell(tr, rate(r.admitted + r.refused, last ? last.admitted + last.refused : 0), "n");
      cell(tr, rate(r.refused, last ? last.refused : 0), "n");
      cell(tr, r.admitted, "n"); cell(tr, r.refused, "n"); cell(tr, r.source, "muted");
    }
    before = { at: now, rules: new Map(rules.rules.map(r => [r.domain + "\u0000" + r.rule, r])) };
    const since = rules.in_force_since ? new Date(rules.in_force_since * 1000).toISOString() : "–";
    document.getElementById("generation").textContent =
      "rules generation " + rules.generation + ", in force since " + since + ", from " + rules.files.join(", ");

    const s = document.getElementById("store");
    s.replaceChildren();
    const p = document.createElement("p");
    p.textContent = (store.ready ? "ready: " : "not ready: ") + store.detail;
    p.className = store.ready ? "ok" : "bad";
    s.appendChild(p);
    if (store.breakers.length) {
      s.appendChild(table(["Redis node", "breaker"], store.breakers.map(b => [b.node, b.open ? "OPEN" : "closed"])));
    }
    s.appendChild(table(["failure mode", "answers since start"], store.failure_mode_answers.map(a => [a.mode, a.answers])));
    // RLQS and regions: shown when they run
    const rlqsOn = rlqs.running && (rlqs.streams > 0 || rlqs.buckets > 0);
    document.getElementById("rlqs-panel").hidden = !rlqsOn;
    if (rlqsOn) {
      const q = document.getElementById("rlqs");
      q.replaceChildren();
      const line = document.createElement("p");
      line.textContent = rlqs.streams + " stream(s), " + rlqs.buckets + " bucket(s), " + rlqs.pairs +
        " (stream, bucket) pair(s), " + rlqs.held + " held for departed Envoys, " + rlqs.outbox_bytes + " bytes queued; " +
        (rlqs.ledger ? (rlqs.ledger_trouble ? "shared ledger NOT answering: " + rlqs.ledger_trouble : "shared ledger answering") : "no shared ledger");
      line.className = rlqs.ledger_trouble ? "bad" : "";
      q.appendChild(line);
      if (rlqs.streams_by_domain.length) {
        q.appendChild(table(["domain", "streams"], rlqs.streams_by_domain.map(d => [d.domain || "(not reported yet)", d.streams])));
      }
    }
    document.getElementById("regions-panel").hidden = !regions.region && !regions.global_tier;
    const g = document.getElementById("regions");
    g.replaceChildren();
    if (regions.region) {
      const r = regions.region;
      const p2 = document.createElement("p");
      p2.textContent = "a region of " + r.regions + ": global tier " + (r.upstream_reachable ? "reachable" : "NOT reachable") +
        ", " + r.buckets + " global bucket(s) held, last assignment " +
        (r.since_last_assignment_secs === null ? "never" : r.since_last_assignment_secs.toFixed(1) + " s ago");
      p2.className = r.upstream_reachable ? "ok" : "bad";
      g.appendChild(p2);
    }
    if (regions.global_tier) {
      const t = regions.global_tier;
      const p3 = document.createElement("p");
      p3.textContent = "the global tier: " + t.regions_reporting.length + " region(s) reporting of " +
        (t.regions_expected === null ? "?" : t.regions_expected) + ": " + t.regions_reporting.join(", ");
      g.appendChild(p3);
    }
    document.getElementById("status").textContent = "updated " + new Date(now).toLocaleTimeString() + " (store: " + store.store + ", " + h.counters + " counters a summary)";
  } catch (e) {
    document.getElementById("status").textContent = "cannot read the service: " + e.message;
  }
}
refresh();
setInterval(refresh, 1000);
