// Home page: the jobs list and the team bars refresh themselves every 10 s (the page is meant
// to stay open all day). The server renders; we fetch the same page and swap the two parts.
(function () {
  "use strict";
  var PARTS = ["jobs", "team-usage", "refreshed"];
  function refresh() {
    if (document.hidden) return;
    fetch(location.href, {credentials: "same-origin", headers: {"X-Requested-With": "refresh"}})
      .then(function (r) { return r.ok ? r.text() : null; })
      .then(function (html) {
        if (!html) return;
        var doc = new DOMParser().parseFromString(html, "text/html");
        PARTS.forEach(function (id) {
          var fresh = doc.getElementById(id), old = document.getElementById(id);
          if (fresh && old) old.replaceWith(fresh);
        });
      })
      .catch(function () { /* offline for a moment: try again next time */ });
  }
  setInterval(refresh, 10000);
  document.addEventListener("visibilitychange", function () { if (!document.hidden) refresh(); });
})();
