// Submit page: an optional memory check of the model the job will train. Asks
// POST /api/v1/plan/ (trainer/planner.py) with the shape below and the job's GPU count, and
// shows the recommended layout and whether it fits. It never touches the job form itself.
(function () {
  "use strict";
  var section = document.getElementById("planner");
  if (!section) return;
  var form = document.getElementById("planner-form");
  var result = document.getElementById("planner-result");
  var button = document.getElementById("planner-check");
  section.hidden = false;  // without JavaScript the section stays hidden: it could do nothing

  var INTEGERS = ["layers", "hidden", "heads", "vocab", "seq", "micro_batch", "gpus_per_node"];
  var GiB = Math.pow(2, 30);

  function gib(bytes) { return (bytes / GiB).toFixed(1) + " GiB"; }

  function el(tag, text, cls) {
    var node = document.createElement(tag);
    if (text !== undefined) node.textContent = text;
    if (cls) node.className = cls;
    return node;
  }

  function csrfToken() {
    var input = document.querySelector("input[name=csrfmiddlewaretoken]");
    return input ? input.value : "";
  }

  function body() {
    var data = {};
    INTEGERS.forEach(function (name) {
      var raw = form.elements[name].value.trim();
      data[name] = raw === "" ? null : (isNaN(Number(raw)) ? raw : Number(raw));
    });
    var params = form.elements.params.value.trim();
    // "7e9" is a number to JavaScript but not an integer string to the API: send the number.
    if (params !== "") data.params = isNaN(Number(params)) ? params : Number(params);
    var mem = form.elements.gpu_mem_gb.value.trim();
    data.gpu_mem_gb = mem === "" ? null : (isNaN(Number(mem)) ? mem : Number(mem));
    data.dtype = form.elements.dtype.value;
    data.optimizer = form.elements.optimizer.value;
    data.activation_checkpointing = form.elements.activation_checkpointing.checked;
    var gpus = document.getElementById("id_gpus");
    var count = gpus ? gpus.value.trim() : "";
    data.gpus = count === "" || isNaN(Number(count)) ? count || null : Number(count);
    return data;
  }

  function showErrors(errors) {
    result.replaceChildren();
    result.appendChild(el("p", "The planner could not use this shape:", "error-text"));
    var list = el("ul", undefined, "errorlist");
    Object.keys(errors).forEach(function (field) {
      var label = field === "gpus" ? "GPUs (job form)" : field.replace(/_/g, " ");
      [].concat(errors[field]).forEach(function (message) {
        list.appendChild(el("li", label + ": " + message));
      });
    });
    result.appendChild(list);
  }

  function showPlan(plan) {
    result.replaceChildren();
    var best = plan.recommended;
    var mem = plan.cluster.gpu_mem_gb * GiB;
    if (best) {
      var b = best.per_gpu_bytes;
      result.appendChild(el("p",
        "Fits. Recommended: dp=" + best.dp + " tp=" + best.tp + " pp=" + best.pp +
        " ZeRO-" + best.zero + ", " + gib(b.total) + " of " + gib(mem) + " per GPU (weights " +
        gib(b.weights) + ", gradients " + gib(b.grads) + ", optimizer " + gib(b.optimizer) +
        ", activations " + gib(b.activations) + ").", "planner-fits"));
    } else {
      result.appendChild(el("p", "Does not fit on " + plan.cluster.gpus + " GPUs.",
        "planner-nofit error-text"));
    }
    var reasons = el("ul");
    plan.reasons.forEach(function (reason) { reasons.appendChild(el("li", reason)); });
    result.appendChild(reasons);
    // The recommendation above orders by traffic; this is what `--layout auto` takes, by the
    // step-time model on the hardware the API names.
    var fast = plan.fastest;
    if (fast) {
      var t = fast.predicted_step;
      result.appendChild(el("p",
        "Fastest predicted on " + plan.hardware.name + " (what layout auto takes): " +
        fast.description + ", step " +
        t.total_s.toFixed(2) + " s (compute " + t.compute_s.toFixed(2) +
        ", exposed communication " + t.exposed_comm_s.toFixed(2) + ", bubble " +
        t.bubble_s.toFixed(2) + ").", "planner-fastest"));
    }
  }

  function check() {
    button.disabled = true;
    result.replaceChildren(el("p", "Checking…", "muted"));
    fetch(section.dataset.url, {
      method: "POST",
      credentials: "same-origin",
      headers: {"Content-Type": "application/json", "X-CSRFToken": csrfToken()},
      body: JSON.stringify(body()),
    }).then(function (response) {
      return response.json().then(function (data) {
        if (response.ok) showPlan(data);
        else showErrors(response.status === 400 ? data : {error: data.detail || response.status});
      });
    }).catch(function (error) {
      showErrors({error: String(error)});
    }).finally(function () {
      button.disabled = false;
    });
  }

  button.addEventListener("click", check);
  form.addEventListener("submit", function (event) { event.preventDefault(); check(); });
})();
