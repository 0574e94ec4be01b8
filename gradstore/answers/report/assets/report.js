// gradstore report page. All store text is put into the page with textContent (never as markup);
// labels handed to Plotly are entity-escaped with plotText.
(function () {
  "use strict";
  const data = JSON.parse(document.getElementById("report-data").textContent);
  const root = document.getElementById("report");
  const PLOT_CONFIG = {displaylogo: false, responsive: true};

  function el(tag, props, children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(props || {})) {
      if (key === "text") node.textContent = value;
      else if (key === "class") node.className = value;
      else node.setAttribute(key, value);
    }
    for (const child of children || []) if (child) node.appendChild(child);
    return node;
  }
  function plotText(value) {
    return String(value).replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;");
  }
  function fmt(value) {
    if (value === null || value === undefined) return "";
    if (typeof value === "number") {
      if (Number.isInteger(value)) return String(value);
      const size = Math.abs(value);
      return size !== 0 && (size < 1e-3 || size >= 1e5) ? value.toExponential(3) : value.toFixed(4);
    }
    return String(value);
  }
  function section(id, title, children) {
    return el("section", {id: id}, [el("h2", {text: title}), ...children]);
  }
  function table(columns, rows, className) {
    const head = el("tr", {}, columns.map((c) => el("th", {text: c})));
    const body = rows.map((row) => el("tr", {}, row.map((cell) =>
      cell instanceof Node ? el("td", {}, [cell]) : el("td", {text: fmt(cell)}))));
    return el("table", {class: className || ""}, [el("thead", {}, [head]), el("tbody", {}, body)]);
  }
  function exampleText(id, tokens) {
    if (tokens && tokens.length) return highlighted(tokens);
    const text = data.texts[id];
    return el("span", {class: text === undefined ? "example-text missing" : "example-text",
                       text: text === undefined ? "(no text in examples)" : text});
  }
  function highlighted(tokens) {
    const peak = Math.max(...tokens.map((t) => Math.abs(t[2]))) || 1;
    const spans = tokens.map(([position, token, score]) => {
      const alpha = (Math.abs(score) / peak * 0.8).toFixed(3);
      const colour = score >= 0 ? `rgba(34,139,34,${alpha})` : `rgba(200,40,40,${alpha})`;
      const span = el("span", {class: "token", title: `token ${position}: ${fmt(score)}`, text: token});
      span.style.backgroundColor = colour;
      return span;
    });
    const out = el("span", {class: "example-text tokens"});
    spans.forEach((span, i) => { if (i) out.appendChild(document.createTextNode(" ")); out.appendChild(span); });
    return out;
  }
  function scoreBars(labels, scores) {
    return [{type: "bar", x: scores, y: labels, orientation: "h",
             marker: {color: scores.map((v) => (v >= 0 ? "#2e8b57" : "#c0392b"))},
             hovertemplate: "%{y}: %{x}<extra></extra>"}];
  }
  function histogram(target, block, title, xTitle) {
    const centres = block.counts.map((_, i) => (block.edges[i] + block.edges[i + 1]) / 2);
    const width = block.edges.length > 1 ? block.edges[1] - block.edges[0] : 1;
    Plotly.newPlot(target, [{type: "bar", x: centres, y: block.counts, width: width, marker: {color: "#4c72b0"},
                             hovertemplate: "%{x:.4g}: %{y}<extra></extra>"}],
                   {title: {text: plotText(title)}, height: 260, margin: {l: 50, r: 10, t: 40, b: 40},
                    xaxis: {title: {text: plotText(xTitle)}}, yaxis: {title: {text: "rows"}}, bargap: 0.02}, PLOT_CONFIG);
  }

  // ---------------------------------------------------------------- notes and overview
  if (data.notes.length) root.appendChild(el("div", {class: "notes"}, data.notes.map((n) => el("p", {text: n}))));
  const overview = data.overview;
  root.appendChild(section("overview", "Store", [
    el("p", {text: `dimension ${fmt(overview.dim)}; example text from column ${overview.text_column ?? "(none)"}` +
                   (data.run ? `; run ${data.run}` : "")}),
    el("h3", {text: "Runs"}),
    table(["run", "created", "dim", "model", "projection", "parameters captured", "not captured"],
      overview.runs.map((r) => [r.run_id, r.created_at, r.dim, r.model_fingerprint, r.projection_fingerprint,
        r.coverage ? `${(100 * r.coverage.fraction).toFixed(1)}% of ${r.coverage.trainable}` : "-",
        r.coverage ? Object.entries(r.coverage.reasons).map(([name, why]) => `${name} (${why})`).join("; ") : "-"])),
    el("h3", {text: "Checkpoints"}),
    table(["run", "checkpoint", "step", "epoch", "learning rate"], overview.checkpoints.map((c) =>
      [c.run_id, c.checkpoint, c.step, c.epoch, c.learning_rate])),
    el("h3", {text: "Tables"}),
    table(["table", "rows"], Object.entries(overview.row_counts)),
  ]));

  // ---------------------------------------------------------------- queries
  const search = el("input", {id: "query-search", type: "search", placeholder: "search queries by id or text",
                              "aria-label": "search queries"});
  const counter = el("p", {class: "counter"});
  const list = el("ul", {id: "query-list"});
  const detail = el("div", {id: "query-detail"}, [el("p", {class: "hint", text: "Pick a query on the left."})]);
  const items = data.queries.map((query) => {
    const text = data.texts[query.id] || "";
    const item = el("li", {}, [el("button", {class: "query-item", type: "button", "data-id": query.id}, [
      el("span", {class: "query-id", text: query.id}), el("span", {class: "query-text", text: text})])]);
    item.firstChild.addEventListener("click", () => openQuery(query, item));
    return {item: item, haystack: (query.id + "\n" + text).toLowerCase()};
  });
  items.forEach(({item}) => list.appendChild(item));
  function filter() {
    const needle = search.value.trim().toLowerCase();
    let shown = 0;
    for (const {item, haystack} of items) {
      const match = !needle || haystack.includes(needle);
      item.hidden = !match;
      shown += match ? 1 : 0;
    }
    counter.textContent = `${shown} of ${data.queries.length} queries shown` +
      (data.queries_total > data.queries.length ? ` (${data.queries_total} in the store)` : "");
  }
  search.addEventListener("input", filter);
  filter();

  function openQuery(query, item) {
    list.querySelectorAll(".selected").forEach((node) => node.classList.remove("selected"));
    item.classList.add("selected");
    detail.replaceChildren(el("h3", {class: "query-title", text: query.id}),
                           el("p", {class: "query-full"}, [exampleText(query.id, query.tokens[""])]));
    if (Object.keys(query.tokens).length) {
      detail.appendChild(el("p", {class: "hint", text: "Token colours: per-token scores from token_scores (green " +
        "supports, red opposes; the query's tokens are summed over the examples they were scored against)."}));
    }
    query.results.forEach((result, i) => {
      const chart = el("div", {class: "score-bars", id: `score-bars-${i}`});
      const heading = `${result.method} · run ${result.run} · checkpoint ${result.checkpoint} · damping ` +
        (result.damping === null ? "n/a" : fmt(result.damping));
      const rows = [];
      const labels = [], scores = [];
      result.proponents.forEach(([id, score], r) => {
        rows.push([`P${r + 1}`, score, id, exampleText(id, query.tokens[id])]);
        labels.push(`P${r + 1}`); scores.push(score);
      });
      result.opponents.forEach(([id, score], r) => {
        rows.push([`O${r + 1}`, score, id, exampleText(id, query.tokens[id])]);
        labels.push(`O${r + 1}`); scores.push(score);
      });
      detail.appendChild(el("div", {class: "result"}, [
        el("h4", {class: "result-title", text: heading}), chart,
        table(["rank", "score", "example", "text"], rows, "results")]));
      Plotly.newPlot(chart, scoreBars(labels, scores),
                     {height: 40 + 22 * labels.length, margin: {l: 40, r: 10, t: 10, b: 30},
                      yaxis: {autorange: "reversed", type: "category"}, xaxis: {title: {text: "score"}}},
                     PLOT_CONFIG);
    });
    if (!query.results.length) detail.appendChild(el("p", {text: "No scores for this query."}));
  }
  root.appendChild(section("queries", "Queries", data.queries.length ? [
    el("div", {class: "query-layout"}, [el("div", {class: "query-side"}, [search, counter, list]), detail]),
  ] : [el("p", {text: "No attributions in the store yet (run gradstore attribute)."})]));

  // ---------------------------------------------------------------- score distributions
  if (data.histograms.length) {
    const grid = el("div", {class: "grid"});
    root.appendChild(section("distributions", "Score distributions (stored top-k rows, per method)", [grid]));
    data.histograms.forEach((block) => {
      const target = el("div", {class: "histogram"});
      grid.appendChild(target);
      histogram(target, block, block.method, "score");
    });
  }

  // ---------------------------------------------------------------- self-influence
  if (data.self_influence.length) {
    const parts = [];
    const charts = [];
    for (const block of data.self_influence) {
      const target = el("div", {class: "histogram"});
      charts.push([target, block]);
      parts.push(el("h3", {text: `${block.method} · run ${block.run} · checkpoint ${block.checkpoint} · ` +
                                 `${block.rows_total} rows`}), target,
                 el("p", {class: "hint", text: "robust z = (value - median) / median absolute deviation"}),
                 table(["self-influence", "robust z", "example", "text"], block.rows.map((r) =>
                   [r.value, r.robust_z, r.example_id, exampleText(r.example_id)]), "outliers"));
    }
    root.appendChild(section("self-influence", "Self-influence outliers", parts));
    charts.forEach(([target, block]) => histogram(target, block, `self-influence (${block.method})`,
                                                      "self-influence"));
  }

  // ---------------------------------------------------------------- selection
  if (data.selection) {
    const s = data.selection;
    const share = s.fraction === null ? "" : ` (${(100 * s.fraction).toFixed(1)}% budget)`;
    const parts = [el("p", {class: "selection-summary",
                            text: `selected ${s.selected} of ${s.candidates ?? "?"} training examples${share}`})];
    const charts = [];
    for (const b of s.breakdown) {
      const target = el("div", {class: "breakdown"});
      charts.push([target, b]);
      parts.push(el("h3", {text: `by ${b.column}`}), target,
                 table([b.column, "candidates", "selected", "selected share"], b.groups.map((g, i) =>
                   [g, b.candidates[i], b.selected[i], b.candidates[i] ? b.selected[i] / b.candidates[i] : null])));
    }
    parts.push(el("h3", {text: "Top selected"}),
               table(["score", "example", "text"], s.top.map((r) => [r.score, r.example_id, exampleText(r.example_id)])));
    root.appendChild(section("selection", "Data selection", parts));
    charts.forEach(([target, b]) => {
      const totalCandidates = b.candidates.reduce((x, y) => x + y, 0) || 1;
      const totalSelected = b.selected.reduce((x, y) => x + y, 0) || 1;
      const groups = b.groups.map(plotText);
      Plotly.newPlot(target, [
        {type: "bar", name: "all candidates", x: groups, y: b.candidates.map((c) => c / totalCandidates)},
        {type: "bar", name: "selected", x: groups, y: b.selected.map((c) => c / totalSelected)},
      ], {barmode: "group", height: 280, margin: {l: 50, r: 10, t: 10, b: 60}, yaxis: {title: {text: "share"}}},
      PLOT_CONFIG);
    });
  }

  // ---------------------------------------------------------------- online selection
  if (data.online_selection) {
    root.appendChild(section("online-selection", "Online selection (kept in the training step)",
      [table(data.online_selection.columns, data.online_selection.rows)]));
  }

  // ---------------------------------------------------------------- evaluations
  if (data.evaluations) {
    const e = data.evaluations;
    const parts = e.summary
      ? [el("h3", {text: "Latest per method (higher is better: LDS a rank correlation, QLD a query-loss increase)"}),
         table(e.summary.columns, e.summary.rows, "evaluation-summary"),
         el("h3", {text: "All evaluations"}), table(e.columns, e.rows, "evaluation-rows")]
      : [table(e.columns, e.rows)];
    root.appendChild(section("evaluations", "Evaluations", parts));
  }
})();
