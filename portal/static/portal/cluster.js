// Cluster page: a tooltip with the job on a GPU, on hover or keyboard focus (the title
// attribute says the same for browsers that show it; this one also shows on touch devices).
(function () {
  "use strict";
  var tip = document.createElement("div");
  tip.id = "gpu-tip";
  tip.setAttribute("role", "tooltip");
  tip.hidden = true;
  document.body.appendChild(tip);
  function show(ev) {
    var gpu = ev.target.closest(".gpu");
    if (!gpu) return;
    var text = gpu.dataset.tip || gpu.getAttribute("title");
    gpu.dataset.tip = text;
    gpu.removeAttribute("title"); // no double tooltip
    tip.textContent = text;
    tip.hidden = false;
    var box = gpu.getBoundingClientRect();
    var left = Math.min(window.scrollX + box.left, window.scrollX + document.documentElement.clientWidth - tip.offsetWidth - 8);
    tip.style.left = Math.max(4, left) + "px";
    tip.style.top = window.scrollY + box.bottom + 6 + "px";
  }
  function hide(ev) {
    if (ev.target.closest(".gpu")) tip.hidden = true;
  }
  var grid = document.getElementById("nodes");
  if (!grid) return;
  grid.addEventListener("mouseover", show);
  grid.addEventListener("focusin", show);
  grid.addEventListener("mouseout", hide);
  grid.addEventListener("focusout", hide);
})();
