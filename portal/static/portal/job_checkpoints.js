// Job page, the checkpoints table: rows for checkpoints committed since the page was drawn,
// each with its register-as-model-version form (job.js calls refresh on a websocket
// `checkpoint` message and after a reconnect). Loaded before job.js, which uses
// window.lockstepJobCheckpoints.
(function () {
  "use strict";
  var page = JSON.parse(document.getElementById("job-data").textContent);
  var jobId = page.job;
  function fmtBytes(n) {
    var units = ["bytes", "KB", "MB", "GB", "TB"], i = 0;
    while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
    return (i ? n.toFixed(1) : n) + " " + units[i];
  }
  // A framework's own save (the agent saw it; docs/training.md) says which framework wrote it.
  var FORMATS = {lightning: "Lightning .ckpt", hf: "Hugging Face checkpoint-N/", torch: "torch.save file"};
  function addCheckpointRows() {
    fetch("/api/v1/jobs/" + jobId + "/checkpoints/", {credentials: "same-origin"})
      .then(function (r) { return r.ok ? r.json() : []; })
      .then(function (list) {
        var body = document.querySelector("#checkpoints tbody");
        var csrf = document.querySelector("input[name=csrfmiddlewaretoken]");
        var name = page.name || document.querySelector("#checkpoints input[name=name]")?.value || "";
        list.slice().reverse().forEach(function (c) {
          // By id: two saves may carry one step (a framework's save named without it).
          if (body.querySelector('tr[data-id="' + c.id + '"]')) return;
          var empty = body.querySelector("tr.empty");
          if (empty) empty.remove();
          var tr = document.createElement("tr");
          tr.dataset.step = c.step;
          tr.dataset.id = c.id;
          tr.className = "fresh";
          var attempts = page.timeline.attempts;
          var number = attempts.length ? attempts[attempts.length - 1].number : "";
          var step = c.format && c.format !== "dcp" ? c.step + " · " + (FORMATS[c.format] || c.format) : c.step;
          var saved = c.save_s ? c.save_s.toFixed(2) + "s" : "—";
          [step, number, fmtBytes(c.bytes), saved, new Date(c.created_at).toTimeString().slice(0, 8)]
            .forEach(function (v, i) {
              var cell = document.createElement("td");
              cell.textContent = v;
              cell.dataset.label = ["Step", "Attempt", "Size", "Save time", "Saved"][i];
              tr.appendChild(cell);
            });
          var td = document.createElement("td");
          td.dataset.label = "Register";
          var form = document.createElement("form");
          form.className = "inline-form register";
          form.method = "post";
          form.action = "/checkpoints/" + c.id + "/register/";
          form.innerHTML = '<input type="hidden" name="csrfmiddlewaretoken"><input name="name" aria-label="model name" required>' +
            '<input name="notes" placeholder="notes (optional)" aria-label="notes"><button type="submit">Register</button>';
          form.elements.csrfmiddlewaretoken.value = csrf ? csrf.value : "";
          form.elements.name.value = name;
          td.appendChild(form);
          tr.appendChild(td);
          body.insertBefore(tr, body.firstChild);
        });
      });
  }

  window.lockstepJobCheckpoints = {refresh: addCheckpointRows};
})();
