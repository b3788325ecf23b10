// Job page, the log panel: one rank's log at a time, its last 500 lines fetched, then lines
// appended live (job.js hands over the websocket's `log` messages) or, for a rank other than
// 0 of a job wider than LIVE_RANKS_MAX, fetched again on job.js's timer. Follow keeps the end
// in view; scrolling up to read stops it. A job of up to LOG_RANK_CHOICES_MAX ranks picks its
// rank from a list, a wider one types it (a number field, with the ranks its step-time chart
// singles out as suggestions). Loaded before job.js, which uses window.lockstepJobLogs.
(function () {
  "use strict";
  var page = JSON.parse(document.getElementById("job-data").textContent);
  var logs = document.getElementById("logs");
  var rankField = document.getElementById("log-rank");
  var follow = document.getElementById("log-follow");
  var status = document.getElementById("log-status");
  var logRank = Number(rankField.value || 0);
  var seq = 0;

  function append(text) {
    logs.textContent = (logs.textContent + text).slice(-200000);
    if (follow.checked) logs.scrollTop = logs.scrollHeight;
  }

  function load() {
    var mine = ++seq;
    logs.textContent = "";
    status.textContent = "loading…";
    fetch("/api/v1/jobs/" + page.job + "/logs/?rank=" + logRank + "&tail=500", {credentials: "same-origin"})
      .then(function (r) { return r.ok ? r.json() : {lines: [], attempt: null}; })
      .then(function (d) {
        if (mine !== seq) return;
        append(d.lines.join("\n") + (d.lines.length ? "\n" : ""));
        status.textContent =
          !d.attempt ? "no logs yet" : "attempt " + d.attempt + ", last " + d.lines.length + " lines, " +
          (page.live_all_ranks === false && logRank !== 0 ? "fetched again every " + page.live_refresh_s + " s" : "then live");
      });
  }

  // A typed rank that is not one of the job's says so and keeps the rank shown.
  rankField.addEventListener("change", function () {
    var n = Number(rankField.value);
    if (rankField.value === "" || !Number.isInteger(n) || n < 0 || n >= page.ranks) {
      status.textContent = "no rank " + rankField.value + ": this job's ranks are 0 to " +
        (page.ranks - 1) + "; showing rank " + logRank;
      return;
    }
    logRank = n;
    load();
  });
  follow.addEventListener("change", function () { if (follow.checked) logs.scrollTop = logs.scrollHeight; });
  logs.addEventListener("scroll", function () {
    follow.checked = logs.scrollTop + logs.clientHeight >= logs.scrollHeight - 5;
  });

  // The ranks a wide job's step-time chart singles out (rank -> "above"/"below" the rest).
  function suggest(lines) {
    var list = document.getElementById("log-rank-suggest");
    if (!list) return;
    list.replaceChildren();
    ["0"].concat(Object.keys(lines).filter(function (r) { return r !== "0"; })).forEach(function (rank) {
      var option = document.createElement("option");
      option.value = rank;
      option.textContent = "rank " + rank +
        (lines[rank] === "above" || lines[rank] === "below" ? " (" + lines[rank] + " the rest)" : "");
      list.appendChild(option);
    });
  }

  window.lockstepJobLogs = {
    load: load,
    rank: function () { return logRank; },
    live: function (rank, text) { if (rank === logRank) append(text); },
    suggest: suggest,
  };
})();
