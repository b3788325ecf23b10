// Job page: the timeline of attempts and events, training charts that keep up live over the
// websocket and fetch full detail for a zoomed range, GPU telemetry per rank, logs per rank
// with follow (job_logs.js) and new checkpoints as they commit (job_checkpoints.js), both loaded first.
//
// Charts ask GET /api/v1/jobs/{id}/metrics/ for at most max_points points per rank: the server
// keeps each step bucket's minimum and maximum, so a million-point series arrives as about
// 2,000 points and spikes stay visible. Zooming asks again for just the visible steps.
// window.lockstepJob exposes what happened (charts drawn, requests made) to tests and benchmarks.
(function () {
  "use strict";
  var page = JSON.parse(document.getElementById("job-data").textContent);
  var jobId = page.job;
  var MAX_POINTS = page.max_points;
  var LIVE_CAP = 50000; // points kept per trace while streaming
  // arrivals: step -> when (epoch s) rank 0's loss for it reached the page (latency checks).
  var state = (window.lockstepJob = {
    ready: false, charts: {}, requests: [], liveAt: [], arrivals: {}, startedAt: performance.now(),
  });
  var config = {responsive: true, displaylogo: false, modeBarButtonsToRemove: ["lasso2d", "select2d"]};
  var webgl = null; // asked on first need: creating a WebGL context costs time
  function hasWebgl() {
    if (webgl === null) {
      try {
        var c = document.createElement("canvas");
        webgl = !!(c.getContext("webgl2") || c.getContext("webgl"));
      } catch (e) {
        webgl = false;
      }
      state.webgl = webgl;
    }
    return webgl;
  }
  // A trace drawn from the server holds at most MAX_POINTS points: SVG draws that quickest.
  // One that grows past GL_POINTS while streaming (or any bigger one) switches to WebGL
  // (scattergl) when the browser has it, so a long live series stays smooth.
  var GL_POINTS = 5000;
  function traceType(points) { return points > GL_POINTS && hasWebgl() ? "scattergl" : "scatter"; }

  function layout(title, ytitle, extra) {
    var l = {
      title: {text: title, font: {size: 14}},
      margin: {l: 55, r: 10, t: 36, b: 40},
      xaxis: {title: {text: "step"}},
      yaxis: {title: {text: ytitle}},
      legend: {orientation: "h", y: -0.25},
      hovermode: "closest",
      uirevision: "keep",
    };
    for (var k in extra || {}) l[k] = extra[k];
    return l;
  }

  // ---- Training metrics -------------------------------------------------------------------
  var SERIES = {
    loss: {el: "loss-chart", title: "Loss (rank 0)", y: "loss", rank: 0},
    tokens_per_s: {el: "throughput-chart", title: "Throughput per rank", y: "tokens/s"},
    step_time_s: {el: "step-time-chart", title: "Step time per rank (stragglers stand out)", y: "seconds"},
  };

  // A job wider than LIVE_RANKS_MAX draws, per metric, the band every rank lies in and the
  // lines of a few ranks (rank 0 and those farthest from the rest: jobs/metrics_spread.py):
  // one line per rank of 4,096 would be 8 million points.
  var LINES = page.live_all_ranks === false ? page.rank_lines : null;

  function metricsUrl(name, range) {
    var s = SERIES[name];
    var url = "/api/v1/jobs/" + jobId + "/metrics/?name=" + name + "&max_points=" + MAX_POINTS;
    if (s.rank !== undefined) url += "&rank=" + s.rank;
    else if (LINES) url += "&lines=" + LINES;
    if (range) url += "&since_step=" + (Math.floor(range[0]) - 1) + "&until_step=" + Math.ceil(range[1]);
    return url;
  }

  function fetchSeries(name, range) {
    var url = metricsUrl(name, range);
    var started = performance.now();
    return fetch(url, {credentials: "same-origin"}).then(function (r) {
      if (!r.ok) throw new Error("metrics " + r.status);
      return r.json();
    }).then(function (data) {
      state.requests.push({name: name, url: url, range: range || null, ms: performance.now() - started});
      return data;
    });
  }

  function traceFor(rank, steps, values, why) {
    var label = "rank " + rank + (why === "above" || why === "below" ? " (" + why + " the rest)" : "");
    return {x: steps, y: values, type: traceType(steps.length), mode: "lines", name: label};
  }

  // Each rank of a fetched answer as a trace appended to `traces`, remembered in `chart`
  // (its trace index, its whole-run points and its last step, for live points and zooms).
  function addRankTraces(chart, data, traces) {
    Object.keys(data.ranks).forEach(function (rank) {
      var series = data.ranks[rank];
      chart.ranks[rank] = traces.length;
      chart.full[rank] = {x: series.step.slice(), y: series.value.slice()};
      chart.last[rank] = series.step.length ? series.step[series.step.length - 1] : -1;
      chart.points += series.step.length;
      traces.push(traceFor(rank, series.step, series.value, (data.lines || {})[rank]));
    });
    chart.downsampled = data.downsampled || {};
  }

  // The band across every rank: its lowest values, then its highest filled down to them.
  function bandTraces(x, low, high, label) {
    var grey = "rgba(100, 116, 139, 0.55)";
    return [
      {x: x, y: low, type: "scatter", mode: "lines", line: {width: 0.5, color: grey}, name: label, legendgroup: "band", showlegend: false, hoverinfo: "x+y"},
      {x: x, y: high, type: "scatter", mode: "lines", line: {width: 0.5, color: grey}, fill: "tonexty", fillcolor: "rgba(148, 163, 184, 0.3)", name: label, legendgroup: "band", hoverinfo: "x+y"},
    ];
  }

  // A wide job's chart, drawn whole from one answer (the band changes with the range).
  function drawSpread(name, data) {
    var s = SERIES[name];
    var chart = state.charts[name];
    var spread = data.spread;
    var traces = spread
      ? bandTraces(spread.step, spread.low, spread.high, "all " + spread.ranks + " ranks: lowest to highest")
      : [];
    chart.ranks = {}; chart.full = {}; chart.last = {}; chart.points = 0;
    addRankTraces(chart, data, traces);
    if (name === "step_time_s") logPanel.suggest(data.lines || {});
    // Nine legend entries wrap to rows: below the axis title, smaller.
    var below = {legend: {orientation: "h", y: -0.4, font: {size: 10}}};
    return Plotly.react(s.el, traces, layout(s.title, s.y, below), config);
  }

  function drawInitial(name) {
    var s = SERIES[name];
    // full: per rank, the whole-run overview (downsampled, plus live points) that a zoom's
    // detail is spliced into, so panning out never shows a hole.
    // pending: live points that came before the chart was drawn, added once it is.
    var chart = (state.charts[name] = {ranks: {}, last: {}, full: {}, zoom: null, seq: 0, points: 0, pending: []});
    return subscribed.then(function () { return fetchSeries(name, null); }).then(function (data) {
      if (data.spread !== undefined) return drawSpread(name, data);
      var traces = [];
      addRankTraces(chart, data, traces);
      return Plotly.newPlot(s.el, traces, layout(s.title, s.y), config);
    }, function () {
      return Plotly.newPlot(s.el, [], layout(s.title, s.y), config);
    }).then(function () {
      chart.drawn = performance.now();
      document.getElementById(s.el).on("plotly_relayout", function (ev) { onZoom(name, ev); });
      chart.pending.splice(0).forEach(function (p) { addPoints(name, p[0], p[1], p[2]); });
    });
  }

  var zoomTimers = {};
  function onZoom(name, ev) {
    if (state.charts[name].restoring) return;
    var range;
    if (ev["xaxis.range[0]"] !== undefined) range = [ev["xaxis.range[0]"], ev["xaxis.range[1]"]];
    else if (ev["xaxis.range"]) range = ev["xaxis.range"];
    else if (ev["xaxis.autorange"]) range = null;
    else return; // a y-only change, a legend click, a resize: nothing to fetch
    clearTimeout(zoomTimers[name]);
    zoomTimers[name] = setTimeout(function () { refetch(name, range); }, 150);
  }

  function refetch(name, range) {
    var chart = state.charts[name];
    var el = document.getElementById(SERIES[name].el);
    var seq = ++chart.seq;
    chart.zoom = range;
    return fetchSeries(name, range).then(function (data) {
      if (seq !== chart.seq) return; // a newer zoom won
      if (data.spread !== undefined) return drawSpread(name, data);
      var xs = [], ys = [], idx = [];
      Object.keys(data.ranks).forEach(function (rank) {
        var series = data.ranks[rank];
        if (chart.ranks[rank] === undefined) {
          chart.ranks[rank] = el.data.length;
          Plotly.addTraces(el, traceFor(rank, [], []));
        }
        var full = chart.full[rank] || {x: [], y: []};
        var x, y;
        if (range) {
          // Overview outside the range, every fetched point inside it.
          var lo = series.step.length ? series.step[0] : range[0];
          var hi = series.step.length ? series.step[series.step.length - 1] : range[1];
          x = []; y = [];
          for (var i = 0; i < full.x.length && full.x[i] < lo; i++) { x.push(full.x[i]); y.push(full.y[i]); }
          x = x.concat(series.step); y = y.concat(series.value);
          for (var j = 0; j < full.x.length; j++) {
            if (full.x[j] > hi) { x.push(full.x[j]); y.push(full.y[j]); }
          }
        } else {
          x = series.step; y = series.value;
          // Keep live points newer than the fetch.
          for (var k = 0; k < full.x.length; k++) {
            if (full.x[k] > (x.length ? x[x.length - 1] : -1)) { x.push(full.x[k]); y.push(full.y[k]); }
          }
          chart.full[rank] = {x: x.slice(), y: y.slice()};
          if (x.length) chart.last[rank] = Math.max(chart.last[rank] ?? -1, x[x.length - 1]);
        }
        idx.push(chart.ranks[rank]);
        xs.push(x);
        ys.push(y);
      });
      if (idx.length) {
        Plotly.restyle(el, {x: xs, y: ys}, idx);
      }
      var detail = document.getElementById("detail-note");
      if (detail) {
        detail.textContent = range
          ? "zoomed " + name + ": steps " + Math.max(0, Math.floor(range[0])) + "–" + Math.ceil(range[1]) +
            (Object.values(data.downsampled || {}).some(Boolean) ? " (min/max per bucket)" : " (every point)")
          : "full series";
      }
    }).catch(function () { /* the next zoom or reload tries again */ });
  }

  // A chart for each scalar the script logs (a TensorBoard tag): those the page was served
  // with, and any that first arrives live.
  var scalarCharts = 0;
  function addScalarSeries(name) {
    if (SERIES[name]) return null;
    var id = "scalar-chart-" + scalarCharts++;
    var card = document.createElement("div");
    card.className = "card";
    var div = document.createElement("div");
    div.id = id;
    div.className = "chart";
    div.dataset.series = name;
    card.appendChild(div);
    document.getElementById("scalar-charts").appendChild(card);
    document.getElementById("scalars-title").hidden = false;
    SERIES[name] = {el: id, title: name, y: name.split("/").pop()};
    return drawInitial(name);
  }

  function addPoints(name, rank, steps, values) {
    var chart = state.charts[name];
    var s = SERIES[name];
    if (!chart || !steps.length) return;
    if (!chart.drawn) { chart.pending.push([rank, steps, values]); return; }
    if (s.rank !== undefined && Number(rank) !== s.rank) return;
    var last = chart.last[rank] ?? -1;
    var xs = [], ys = [];
    for (var i = 0; i < steps.length; i++) {
      if (steps[i] > last) { xs.push(steps[i]); ys.push(values[i]); }
    }
    if (!xs.length) return;
    chart.last[rank] = xs[xs.length - 1];
    var full = (chart.full[rank] = chart.full[rank] || {x: [], y: []});
    Array.prototype.push.apply(full.x, xs);
    Array.prototype.push.apply(full.y, ys);
    if (full.x.length > LIVE_CAP) { full.x.splice(0, full.x.length - LIVE_CAP); full.y.splice(0, full.y.length - LIVE_CAP); }
    var el = document.getElementById(s.el);
    if (chart.ranks[rank] === undefined) {
      chart.ranks[rank] = el.data.length;
      Plotly.addTraces(el, traceFor(rank, xs.slice(), ys.slice()));
    } else {
      var index = chart.ranks[rank];
      Plotly.extendTraces(el, {x: [xs], y: [ys]}, [index], LIVE_CAP);
      var trace = el.data[index];
      if (trace.type !== traceType(trace.x.length)) {
        // Plotly autoscales on a type change: put a zoomed view back without re-fetching.
        var xa = el.layout.xaxis, ya = el.layout.yaxis;
        var view = xa.autorange ? null : {"xaxis.range": xa.range.slice(), "yaxis.range": ya.range.slice()};
        Plotly.restyle(el, {type: traceType(trace.x.length)}, [index]);
        if (view) {
          chart.restoring = true;
          Plotly.relayout(el, view).then(function () { chart.restoring = false; });
        }
      }
    }
  }

  // ---- GPU telemetry: the run's kept readings, then the latest ones polled while it runs ----
  // GET /api/v1/jobs/{id}/gpus/history/ has what the portal kept from the nodes' heartbeats
  // (every GPU_SAMPLE_S, averaged into time buckets for long runs); /gpus/ the latest reading.
  var LIVE_STATES = ["STARTING", "RUNNING", "PREEMPTING"];
  var GIB = Math.pow(2, 30);
  var gpu = {traces: {}, timer: null, history: null};
  state.gpu = gpu;
  function gpuLayout(title, ytitle) {
    return layout(title, ytitle, {
      xaxis: {type: "date", tickformat: "%H:%M:%S", nticks: 4},
      yaxis: {title: {text: ytitle}, rangemode: "tozero"},
      legend: {orientation: "h", y: -0.2},
    });
  }
  Plotly.newPlot("gpu-util-chart", [], gpuLayout("GPU utilization per rank", "%"), config);
  Plotly.newPlot("gpu-mem-chart", [], gpuLayout("GPU memory per rank", "GiB"), config);

  // Every rank's new readings in one call per chart: Plotly redraws the chart on each
  // addTraces/extendTraces, so one call per rank made a 128-rank page take minutes.
  function gpuPoints(items) {
    var added = {util: [], mem: []};
    var grown = {util: {x: [], y: []}, mem: {x: [], y: []}, idx: []};
    items.forEach(function (it) {
      var key = it.attempt + ":" + it.rank;
      if (gpu.traces[key] === undefined) {
        gpu.traces[key] = Object.keys(gpu.traces).length;
        var name = "rank " + it.rank + " (" + it.node + ":" + it.gpu + ")" + (it.attempt > 1 ? ", attempt " + it.attempt : "");
        added.util.push({x: it.xs, y: it.utils, type: "scatter", mode: "lines+markers", name: name});
        added.mem.push({x: it.xs, y: it.mems, type: "scatter", mode: "lines+markers", name: name});
      } else {
        grown.idx.push(gpu.traces[key]);
        grown.util.x.push(it.xs); grown.util.y.push(it.utils);
        grown.mem.x.push(it.xs); grown.mem.y.push(it.mems);
      }
    });
    if (grown.idx.length) {
      Plotly.extendTraces("gpu-util-chart", grown.util, grown.idx, 20000);
      Plotly.extendTraces("gpu-mem-chart", grown.mem, grown.idx, 20000);
    }
    if (added.util.length) {
      Plotly.addTraces("gpu-util-chart", added.util);
      Plotly.addTraces("gpu-mem-chart", added.mem);
    }
  }
  // CPU slots have no memory figure: say so on the memory chart itself, not as empty axes
  // under a legend (set again only when it changes: a relayout redraws the chart).
  var MEMORY_NOTE = {text: "No memory reading on CPU slots", xref: "paper", yref: "paper",
    x: 0.5, y: 0.5, showarrow: false, font: {color: "#64748b", size: 13}};
  function memoryNote(cpu) {
    if (gpu.memoryNote === cpu) return;
    gpu.memoryNote = cpu;
    Plotly.relayout("gpu-mem-chart", {annotations: cpu ? [MEMORY_NOTE] : []});
  }
  function gpuNote(cpu) {
    memoryNote(cpu);
    var note = document.getElementById("gpu-note");
    var source = cpu
      ? "CPU slots: utilization is the host's load share; no memory reading."
      : "From the nodes' heartbeats (NVML).";
    var kept = gpu.history && gpu.history.bucket_s
      ? " Whole run: one point per " + gpu.history.bucket_s + " s per rank (mean)."
      : "";
    note.textContent = source + kept;
  }
  // A wide job: the latest attempt's utilization band across ranks and a few ranks' lines,
  // fetched again every live_refresh_s while it runs (no per-rank poll of 4,096 GPUs).
  function loadGpuSpread() {
    return fetch("/api/v1/jobs/" + jobId + "/gpus/history/?lines=" + LINES, {credentials: "same-origin"})
      .then(function (r) { return r.ok ? r.json() : null; })
      .then(function (data) {
        gpu.history = data || {series: []};
        var band = gpu.history.spread;
        var util = [], mem = [];
        var cpu = true;
        if (band) {
          var bx = band.t.map(function (t) { return new Date(t * 1000); });
          util = bandTraces(bx, band.low, band.high, "all " + band.ranks + " ranks: lowest to highest");
          util.push({x: bx, y: band.mean, type: "scatter", mode: "lines", line: {dash: "dot", color: "#475569"}, name: "mean of all ranks"});
        }
        gpu.history.series.forEach(function (s) {
          cpu = cpu && !s.mem_total;
          var xs = s.t.map(function (t) { return new Date(t * 1000); });
          var name = "rank " + s.rank + (s.node ? " (" + s.node + ":" + s.gpu + ")" : "");
          util.push({x: xs, y: s.util, type: "scatter", mode: "lines", name: name});
          mem.push({x: xs, y: s.mem_used.map(function (m) { return s.mem_total && m !== null ? m / GIB : null; }), type: "scatter", mode: "lines", name: name});
        });
        gpu.traces = {spread: util.length};
        Plotly.react("gpu-util-chart", util, gpuLayout("GPU utilization: every rank's band, a few ranks' lines", "%"), config);
        cpu = cpu && gpu.history.series.length > 0;
        var memLayout = gpuLayout("GPU memory of the drawn ranks", "GiB");
        memLayout.annotations = cpu ? [MEMORY_NOTE] : [];  // in the same draw, not a second
        Plotly.react("gpu-mem-chart", mem, memLayout, config);
        gpu.memoryNote = cpu;
        if (band) {
          gpuNote(cpu);
          document.getElementById("gpu-note").textContent +=
            " " + band.ranks + " ranks: the band is every rank's lowest to highest; lines for rank 0 and the ranks farthest from the rest.";
        }
      })
      .catch(function () { gpu.history = {series: []}; });
  }
  function loadGpuHistory() {
    if (LINES) return loadGpuSpread();
    return fetch("/api/v1/jobs/" + jobId + "/gpus/history/", {credentials: "same-origin"})
      .then(function (r) { return r.ok ? r.json() : null; })
      .then(function (data) {
        gpu.history = data || {series: []};
        var cpu = true;
        gpuPoints(gpu.history.series.map(function (s) {
          cpu = cpu && !s.mem_total;
          return {
            attempt: s.attempt, rank: s.rank, node: s.node, gpu: s.gpu,
            xs: s.t.map(function (t) { return new Date(t * 1000); }),
            utils: s.util,
            mems: s.mem_used.map(function (m) { return s.mem_total && m !== null ? m / GIB : null; }),
          };
        }));
        if (gpu.history.series.length) gpuNote(cpu);
      })
      .catch(function () { gpu.history = {series: []}; });
  }
  function pollGpus() {
    fetch("/api/v1/jobs/" + jobId + "/gpus/", {credentials: "same-origin"})
      .then(function (r) { return r.ok ? r.json() : null; })
      .then(function (data) {
        if (!data) return;
        if (!data.gpus.length) {
          if (!Object.keys(gpu.traces).length) document.getElementById("gpu-note").textContent = "No GPUs held right now.";
          return;
        }
        gpuNote(data.gpus.every(function (g) { return g.kind === "cpu"; }));
        var now = new Date();
        gpuPoints(data.gpus.map(function (g) {
          return {
            attempt: data.attempt, rank: g.rank, node: g.node, gpu: g.gpu,
            xs: [now], utils: [g.util], mems: [g.mem_total ? g.mem_used / GIB : null],
          };
        }));
      })
      .catch(function () {});
  }
  var gpuHistoryLoaded = loadGpuHistory();
  gpuHistoryLoaded.then(function () { state.gpuReadyAt = performance.now(); });
  function watchGpus(jobState) {
    gpuHistoryLoaded.then(function () {
      var live = LIVE_STATES.indexOf(jobState) >= 0;
      var poll = LINES ? loadGpuSpread : pollGpus;
      var every = LINES ? 1000 * (page.live_refresh_s || 15) : 5000;
      if (live && !gpu.timer) { if (!LINES) poll(); gpu.timer = setInterval(poll, every); }
      if (!live && gpu.timer) { clearInterval(gpu.timer); gpu.timer = null; }
      if (!live && !Object.keys(gpu.traces).length) {
        document.getElementById("gpu-note").textContent = "No GPU readings were kept for this job (it never ran).";
      }
    });
  }

  // ---- Timeline of attempts and events ----------------------------------------------------
  var COLOURS = {
    running: "#16a34a", starting: "#f59e0b", stopping: "#f59e0b", succeeded: "#2563eb",
    failed: "#dc2626", lost: "#dc2626", preempted: "#9333ea", cancelled: "#6b7280",
  };
  var GROUPS = {
    start: ["#16a34a", "triangle-right"], failure: ["#dc2626", "x"], warning: ["#ea580c", "triangle-up"],
    restart: ["#f59e0b", "circle-open"],
    preemption: ["#9333ea", "diamond"], checkpoint: ["#2563eb", "square"], other: ["#6b7280", "circle"],
  };
  function drawTimeline() {
    var t = page.timeline;
    var traces = [];
    t.attempts.forEach(function (a) {
      var end = a.end || t.now;
      traces.push({
        x: [a.start, end], y: ["attempt " + a.number, "attempt " + a.number], type: "scatter",
        mode: "lines", line: {width: 14, color: COLOURS[a.state] || "#6b7280"}, showlegend: false,
        hoverinfo: "text",
        text: ["attempt " + a.number + ": " + a.state + " (steps " + a.resumed_from_step + "–" + a.last_step + ")" +
               (a.reason ? "<br>" + a.reason : "")],
        hoverlabel: {namelength: 0},
      });
    });
    var groups = {};
    t.events.forEach(function (e) { (groups[e.group] = groups[e.group] || []).push(e); });
    Object.keys(GROUPS).forEach(function (group) {
      var list = groups[group];
      if (!list) return;
      traces.push({
        x: list.map(function (e) { return e.time; }), y: list.map(function () { return "events"; }),
        type: "scatter", mode: "markers", name: group,
        marker: {size: 11, color: GROUPS[group][0], symbol: GROUPS[group][1], line: {width: 1.5, color: GROUPS[group][0]}},
        text: list.map(function (e) { return e.kind + ": " + e.message; }), hoverinfo: "text+x",
      });
    });
    var rows = t.attempts.length + 1;
    var el = document.getElementById("timeline-chart");
    el.style.height = Math.max(170, 90 + 34 * rows) + "px";
    return Plotly.newPlot(el, traces, {
      margin: {l: 80, r: 10, t: 10, b: 30}, xaxis: {type: "date"},
      yaxis: {type: "category", categoryorder: "array",
              categoryarray: ["events"].concat(t.attempts.map(function (a) { return "attempt " + a.number; }).reverse()),
              automargin: true},
      legend: {orientation: "h", y: -0.35}, hovermode: "closest",
    }, config);
  }

  // ---- Logs per rank, with follow: job_logs.js -------------------------------------------
  var logPanel = window.lockstepJobLogs;

  // ---- Checkpoints as they commit: job_checkpoints.js --------------------------------------
  var addCheckpointRows = window.lockstepJobCheckpoints.refresh;

  // ---- Websocket: metrics, state, logs, checkpoints ----------------------------------------
  // The socket opens at once; points that come before a chart is drawn wait for it. Each push
  // carries its sender process (src) and its number among that sender's pushes to this job
  // (seq, jobs/notify.py). A number skipped means a push was lost on the way (a full channel
  // queue, a stalled portal process), and a socket that had to reconnect missed whatever was
  // pushed meanwhile: either way the page fetches again what it shows (refill), instead of
  // keeping a hole in a chart for as long as it stays open.
  var live = 0;
  // The charts' first fetch waits until the socket is subscribed to the job's pushes: the
  // consumer sends "state" only after joining the job's group (jobs/consumers.py). A fetch
  // read before that, while the portal is busy, could miss points pushed in between, and no
  // gap in the numbering would show it (the socket's first number is its start). A socket
  // not subscribed within 3 s does not hold the charts back.
  var subscribed = new Promise(function (resolve) {
    state.onSubscribed = resolve;
    setTimeout(resolve, 3000);
  });
  var lastSeq = {}; // src -> the highest seq seen
  var refillTimer = null;
  state.gaps = [];
  state.refills = 0;
  state.sockets = 0;
  function noteSeq(msg) {
    if (msg.src === undefined || msg.seq === undefined) return;
    var last = lastSeq[msg.src];
    if (last !== undefined && msg.seq > last + 1) {
      state.gaps.push({src: msg.src, after: last, missing: msg.seq - last - 1, at: Date.now()});
      scheduleRefill();
    }
    // A count that starts again (the sender forgot this job, or restarted) is a new start.
    if (last === undefined || msg.seq > last || msg.seq === 1) lastSeq[msg.src] = msg.seq;
  }
  function scheduleRefill() {
    clearTimeout(refillTimer);
    refillTimer = setTimeout(refill, 500); // one refill for a burst of gaps
  }
  function refill() {
    state.refills += 1;
    Object.keys(state.charts).forEach(function (name) {
      var chart = state.charts[name];
      if (!chart.drawn) return; // its first fetch is still to come, and covers it
      var zoom = chart.zoom;
      // The overview first, then the zoomed detail again on top of it.
      refetch(name, null).then(function () { if (zoom) return refetch(name, zoom); });
    });
    logPanel.load();
    addCheckpointRows();
  }
  function onMessage(ev) {
    var msg = JSON.parse(ev.data);
    noteSeq(msg);
    if (msg.type === "metrics") {
      var grouped = {};
      var arrived = Date.now() / 1000;
      msg.points.forEach(function (p) {
        if (p.name === "loss" && Number(p.rank) === 0) state.arrivals[p.step] = arrived;
        var key = p.name + "|" + p.rank;
        var g = (grouped[key] = grouped[key] || {name: p.name, rank: p.rank, s: [], v: []});
        g.s.push(p.step); g.v.push(p.value);
      });
      Object.keys(grouped).forEach(function (k) {
        var g = grouped[k];
        if (SERIES[g.name]) addPoints(g.name, String(g.rank), g.s, g.v);
        else addScalarSeries(g.name);
      });
      live += msg.points.length;
      state.liveAt.push(Date.now());
      document.getElementById("live-count").textContent = live;
    } else if (msg.type === "state") {
      state.onSubscribed();
      var el = document.getElementById("job-state");
      el.textContent = msg.state;
      el.className = "state state-" + msg.state;
      document.getElementById("job-reason").textContent = msg.reason || "";
      watchGpus(msg.state);
    } else if (msg.type === "log") {
      logPanel.live(Number(msg.rank), msg.text);
    } else if (msg.type === "checkpoint") {
      addCheckpointRows();
    }
  }
  function connect() {
    var proto = location.protocol === "https:" ? "wss" : "ws";
    var ws = (state.ws = new WebSocket(proto + "://" + location.host + "/ws/jobs/" + jobId + "/"));
    ws.onmessage = onMessage;
    ws.onopen = function () {
      state.sockets += 1;
      if (state.sockets > 1) { lastSeq = {}; scheduleRefill(); } // missed while away
    };
    ws.onclose = function (ev) { if (ev.code !== 4404) setTimeout(connect, 2000); };
  }

  // A job wider than LIVE_RANKS_MAX pushes rank 0 live only (jobs/actions/heartbeat.py): its
  // per-rank charts, and the logs of another rank, are fetched again on a timer instead.
  if (page.live_all_ranks === false) {
    state.wideRefreshes = 0;
    setInterval(function () {
      if (LIVE_STATES.indexOf(document.getElementById("job-state").textContent) < 0) return;
      state.wideRefreshes += 1;
      Object.keys(state.charts).forEach(function (name) {
        var chart = state.charts[name];
        if (chart.drawn && SERIES[name].rank === undefined) refetch(name, chart.zoom);
      });
      if (logPanel.rank() !== 0) logPanel.load();
    }, 1000 * (page.live_refresh_s || 15));
  }

  connect();
  logPanel.load();
  watchGpus(page.state);
  var charts = Object.keys(SERIES).map(drawInitial).concat((page.scalars || []).map(addScalarSeries));
  Promise.all(charts).then(function () {
    state.ready = true;
    state.readyAt = performance.now();
    document.documentElement.dataset.chartsReady = "1";
  });
  drawTimeline();
})();
