// Job page, the Progress row: drawn again from the portal (views.job_progress, the same
// template as the page's) every few seconds while the job is live, so that its step, pace and
// projected end move as the run does; a job that starts while the page is open gets the row
// once its script has said how many steps it takes. job.js shows the job's state in
// #job-state, which this reads.
(function () {
  "use strict";
  var page = JSON.parse(document.getElementById("job-data").textContent);
  var LIVE_STATES = ["STARTING", "RUNNING", "PREEMPTING"];
  var EVERY_MS = 5000;
  var row = document.getElementById("progress-row");
  var state = (window.lockstepJobProgress = {redraws: 0});
  function live() {
    var el = document.getElementById("job-state");
    return LIVE_STATES.indexOf(el ? el.textContent : page.state) >= 0;
  }
  function redraw() {
    return fetch("/jobs/" + page.job + "/progress/", {credentials: "same-origin"})
      .then(function (r) { return r.ok ? r.text() : null; })
      .then(function (html) {
        if (html === null) return;
        row.innerHTML = html;
        row.hidden = !row.querySelector("#progress");
        state.redraws += 1;
      })
      .catch(function () { /* the next tick tries again */ });
  }
  var wasLive = live();
  setInterval(function () {
    var now = live();
    // Once more after the job has left its live states: the row then empties.
    if (now || wasLive) redraw();
    wasLive = now;
  }, EVERY_MS);
})();
