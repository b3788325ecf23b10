// Admin console: draws the figures a page embeds as JSON (id "report-figures") into the
// elements "fig-<name>", with the locally served plotly.js.
(function () {
  const source = document.getElementById("report-figures");
  if (!source || typeof Plotly === "undefined") return;
  const figures = JSON.parse(source.textContent);
  for (const [name, fig] of Object.entries(figures)) {
    const el = document.getElementById("fig-" + name);
    if (el) Plotly.newPlot(el, fig.data, fig.layout, {responsive: true, displaylogo: false});
  }
})();
