// Quilt console: progressive enhancement on top of server-rendered pages (htmx does the partial swaps).
// Every form here also works without this script; the script adds confirmations, copy buttons,
// upload progress and live updates over the console websocket.
(function () {
  "use strict";

  // Confirmation dialogs: <form data-confirm="Text" data-confirm-title="..." data-confirm-button="...">
  function confirmDialog(form) {
    var dialog = document.getElementById("confirm-dialog");
    dialog.querySelector("[data-dialog-title]").textContent = form.dataset.confirmTitle || "Are you sure?";
    dialog.querySelector("[data-dialog-text]").textContent = form.dataset.confirm;
    var ok = dialog.querySelector("[data-dialog-ok]");
    ok.textContent = form.dataset.confirmButton || "Confirm";
    ok.className = "btn " + (form.dataset.confirmTone === "primary" ? "btn-primary" : "btn-danger");
    dialog.returnValue = "";
    dialog.onclose = function () {
      if (dialog.returnValue === "ok") {
        form.dataset.confirmed = "yes";
        form.requestSubmit();
      }
    };
    dialog.showModal();
  }

  document.addEventListener("submit", function (event) {
    var form = event.target;
    if (form.dataset.confirm && form.dataset.confirmed !== "yes") {
      event.preventDefault();
      confirmDialog(form);
      return;
    }
    if (form.hasAttribute("data-upload")) {
      event.preventDefault();
      upload(form);
    }
  });

  // Copy buttons: <button data-copy="#element-id">
  document.addEventListener("click", function (event) {
    var button = event.target.closest("[data-copy]");
    if (!button) return;
    var text = document.querySelector(button.dataset.copy).textContent.trim();
    var done = function () {
      var label = button.querySelector("[data-copy-label]") || button;
      var before = label.textContent;
      label.textContent = "Copied";
      button.classList.add("copied");
      setTimeout(function () { label.textContent = before; button.classList.remove("copied"); }, 1800);
    };
    if (navigator.clipboard && window.isSecureContext) {
      navigator.clipboard.writeText(text).then(done);
    } else {
      var area = document.createElement("textarea");
      area.value = text;
      document.body.appendChild(area);
      area.select();
      document.execCommand("copy");
      area.remove();
      done();
    }
  });

  // Buttons that open a collapsed panel on the page: <a data-open="panel-id">
  document.addEventListener("click", function (event) {
    var opener = event.target.closest("[data-open]");
    if (!opener) return;
    var panel = document.getElementById(opener.dataset.open);
    if (!panel) return;
    event.preventDefault();
    panel.open = true;
    panel.scrollIntoView({behavior: "smooth", block: "start"});
    var first = panel.querySelector("input, select, textarea");
    if (first) first.focus({preventScroll: true});
  });

  // Tenant switcher and other selects that navigate: <select data-navigate>
  document.addEventListener("change", function (event) {
    if (event.target.matches("select[data-navigate], select[data-autosubmit]")) event.target.form.requestSubmit();
    if (event.target.matches("[data-dropzone] input[type=file]")) showChosenFile(event.target);
    if (event.target.matches("#id_adapter")) toggleNewAdapterFields(event.target);
  });

  // The upload form asks for a name and base model only when it creates a new adapter.
  function toggleNewAdapterFields(select) {
    document.querySelectorAll("[data-new-adapter]").forEach(function (element) {
      element.hidden = select.value !== "";
    });
  }

  // Every chosen file is listed (a folder's adapter_config.json and adapter_model.safetensors come as two).
  function showChosenFile(input) {
    var zone = input.closest("[data-dropzone]");
    var name = zone.querySelector("[data-file-name]");
    var list = zone.parentElement.querySelector("[data-file-list]");
    if (!input.files.length) return;
    var total = 0;
    if (list) list.textContent = "";
    Array.prototype.forEach.call(input.files, function (file) {
      total += file.size;
      if (!list) return;
      var item = document.createElement("li");
      item.textContent = file.name + " · " + formatBytes(file.size);
      list.appendChild(item);
    });
    if (list) list.hidden = false;
    name.textContent = input.files.length === 1
      ? input.files[0].name + " · " + formatBytes(total)
      : input.files.length + " files · " + formatBytes(total);
  }

  document.addEventListener("dragover", function (event) {
    var zone = event.target.closest && event.target.closest("[data-dropzone]");
    if (!zone) return;
    event.preventDefault();
    zone.classList.add("over");
  });
  document.addEventListener("dragleave", function (event) {
    var zone = event.target.closest && event.target.closest("[data-dropzone]");
    if (zone) zone.classList.remove("over");
  });
  document.addEventListener("drop", function (event) {
    var zone = event.target.closest && event.target.closest("[data-dropzone]");
    if (!zone) return;
    event.preventDefault();
    zone.classList.remove("over");
    var input = zone.querySelector("input[type=file]");
    input.files = event.dataTransfer.files;
    showChosenFile(input);
  });

  function formatBytes(bytes) {
    var units = ["B", "KB", "MB", "GB"];
    var i = 0;
    while (bytes >= 1024 && i < units.length - 1) { bytes /= 1024; i++; }
    return (i ? bytes.toFixed(1) : bytes) + " " + units[i];
  }

  // Uploads with a progress bar: <form data-upload> posts through XHR so upload progress can be shown;
  // the server answers JSON {redirect} on success or {errors} (HTTP 400) on a refused upload.
  function upload(form) {
    var box = form.querySelector("[data-progress]");
    var bar = box.querySelector(".progress > span");
    var label = box.querySelector("[data-progress-label]");
    var errors = form.querySelector("[data-upload-errors]");
    var submit = form.querySelector("[type=submit]");
    var xhr = new XMLHttpRequest();
    box.hidden = false;
    errors.hidden = true;
    submit.disabled = true;
    xhr.upload.addEventListener("progress", function (event) {
      if (!event.lengthComputable) return;
      var pct = Math.round((event.loaded / event.total) * 100);
      bar.style.width = pct + "%";
      box.dataset.percent = pct;
      label.textContent = formatBytes(event.loaded) + " of " + formatBytes(event.total) + " · " + pct + "%";
    });
    xhr.upload.addEventListener("load", function () { label.textContent = "Uploaded · checking the file…"; });
    xhr.addEventListener("load", function () {
      var body = {};
      try { body = JSON.parse(xhr.responseText); } catch (e) { body = {errors: ["The server answered " + xhr.status + "."]}; }
      if (xhr.status < 300 && body.redirect) {
        window.location.assign(body.redirect);
        return;
      }
      submit.disabled = false;
      box.hidden = true;
      errors.hidden = false;
      errors.textContent = (body.errors || ["The upload failed."]).join(" ");
    });
    xhr.addEventListener("error", function () {
      submit.disabled = false;
      errors.hidden = false;
      errors.textContent = "The connection dropped during the upload. Try again.";
    });
    xhr.open("POST", form.action);
    xhr.setRequestHeader("X-Requested-With", "XMLHttpRequest");
    xhr.send(new FormData(form));
  }

  // Charts: a tooltip of the bucket under the pointer, on hover and on tap, beside that bucket. The whole plot is
  // the target (an hour of a week is a few pixels wide on a phone): the nearest bucket to the pointer's x is read
  // out. Its text is the bucket's <title>, which the server writes for pages without scripts; with scripts it
  // moves to data-readout, so the browser's own slow title tooltip never shows over this one.
  function adoptTitles(svg) {
    svg.querySelectorAll("g.bucket > title, g.day > title").forEach(function (title) {
      title.parentNode.dataset.readout = title.textContent;
      title.remove();
    });
  }
  function chartReadout(event) {
    var svg = event.target.closest && event.target.closest("svg.chart");
    if (!svg) return;
    adoptTitles(svg);
    var buckets = svg.querySelectorAll("g.bucket, g.day");
    if (!buckets.length) return;
    var nearest = null, nearestBox = null, distance = Infinity;
    buckets.forEach(function (bucket) {
      var box = bucket.lastElementChild.getBoundingClientRect();
      var gap = Math.abs(box.left + box.width / 2 - event.clientX);
      if (gap < distance) { distance = gap; nearest = bucket; nearestBox = box; }
    });
    var holder = svg.parentElement;
    holder.classList.add("chart-wrap");
    var readout = holder.querySelector(".chart-readout");
    if (!readout) {
      readout = document.createElement("div");
      readout.className = "chart-readout";
      readout.setAttribute("role", "status");
      holder.appendChild(readout);
    }
    svg.querySelectorAll(".active").forEach(function (node) { node.classList.remove("active"); });
    nearest.classList.add("active");
    readout.textContent = nearest.dataset.readout;
    readout.hidden = false;
    // Beside the bucket, on whichever side has room, and never past the card's edges.
    var area = holder.getBoundingClientRect(), width = readout.offsetWidth, gap = 10;
    var center = nearestBox.left + nearestBox.width / 2 - area.left;
    var left = center + gap + width <= area.width ? center + gap : center - gap - width;
    readout.style.left = Math.max(0, Math.min(left, area.width - width)) + "px";
    readout.style.top = Math.max(0, event.clientY - area.top - readout.offsetHeight - gap) + "px";
  }

  // Chart text: the SVG scales with its card, so its axis font is set in the chart's own units to be at least
  // MIN_CHART_TEXT_PX on screen at any width (the stylesheet's sizes are the floor where the chart is large).
  var MIN_CHART_TEXT_PX = 12.5;
  var chartSizes = window.ResizeObserver ? new ResizeObserver(function (entries) {
    entries.forEach(function (entry) { fitChartText(entry.target); });
  }) : null;
  function fitChartText(svg) {
    var drawn = svg.getBoundingClientRect().width;
    if (!drawn) return;
    svg.style.setProperty("--axis-min", (MIN_CHART_TEXT_PX * svg.viewBox.baseVal.width / drawn).toFixed(2) + "px");
  }
  function fitCharts() {
    document.querySelectorAll("svg.chart").forEach(function (svg) {
      fitChartText(svg);
      if (chartSizes) chartSizes.observe(svg);
    });
  }
  document.addEventListener("pointermove", function (event) {
    if (event.pointerType !== "mouse") return;
    if (event.target.closest && event.target.closest("svg.chart")) { chartReadout(event); return; }
    document.querySelectorAll(".chart-readout").forEach(function (readout) { readout.hidden = true; });
  });
  // A tap (or click) outside every chart closes the readouts, as does Escape: on a touch screen nothing else would.
  function closeReadouts() {
    document.querySelectorAll(".chart-readout").forEach(function (readout) { readout.hidden = true; });
    document.querySelectorAll("svg.chart .active").forEach(function (node) { node.classList.remove("active"); });
  }
  document.addEventListener("pointerdown", function (event) {
    if (event.target.closest && event.target.closest("svg.chart")) chartReadout(event);
    else closeReadouts();
  });
  document.addEventListener("keydown", function (event) { if (event.key === "Escape") closeReadouts(); });

  // Live updates: <body data-live="/ws/..."> opens the console websocket. Messages:
  //   {"type": "html", "target": id, "html": ...}  replace that element with server-rendered HTML
  //   {"type": "refresh"}                          re-fetch the page's [data-live-region] elements
  // The server closes a socket it refuses (logged out, no longer a member) with 4403: retrying can't help, so stop
  // and say so. Any other close is a dropped network or a restarting server: retry, waiting longer each time.
  var FORBIDDEN = 4403, RETRY_FIRST_MS = 1000, RETRY_MAX_MS = 30000;
  var socketUp = false, retryMs = RETRY_FIRST_MS;
  function connect(path) {
    var scheme = window.location.protocol === "https:" ? "wss://" : "ws://";
    var socket = new WebSocket(scheme + window.location.host + path);
    var indicator = document.querySelector("[data-live-indicator]");
    socket.onopen = function () {
      socketUp = true;
      retryMs = RETRY_FIRST_MS;
      if (indicator) { indicator.classList.add("on"); indicator.textContent = "Live"; }
      document.body.dataset.liveConnected = "yes";
      // Work still in flight may have finished before this socket subscribed: catch up once.
      if (document.querySelector("[data-live-pending]")) refreshRegions("connect");
    };
    socket.onclose = function (event) {
      socketUp = false;
      if (indicator) indicator.classList.remove("on");
      if (event.code === FORBIDDEN) {
        if (indicator) indicator.textContent = "Live updates off: reload the page";
        document.body.dataset.liveConnected = "refused";
        return;
      }
      if (indicator) indicator.textContent = "Reconnecting…";
      document.body.dataset.liveConnected = "no";
      setTimeout(function () { connect(path); }, retryMs);
      retryMs = Math.min(retryMs * 2, RETRY_MAX_MS);
    };
    socket.onmessage = function (event) {
      var message = JSON.parse(event.data);
      if (message.type === "html") {
        var target = document.getElementById(message.target);
        if (target) target.outerHTML = message.html;
        fitCharts();
      } else if (message.type === "refresh") {
        refreshRegions("socket");
      }
    };
  }

  // `reason` is kept on <body data-live-refreshed-by> so a page (and its tests) can tell how it learned news.
  // One fetch at a time: news that arrives while one is in flight fetches again once it lands (never dropped,
  // so the last push always shows).
  var refreshing = false, refreshAgain = false;
  function refreshRegions(reason) {
    document.body.dataset.liveRefreshedBy = reason;
    if (refreshing) { refreshAgain = true; return; }
    refreshing = true;
    fetch(window.location.href, {credentials: "same-origin", cache: "no-store"})
      .then(function (response) { return response.text(); })
      .then(function (html) {
        var fresh = new DOMParser().parseFromString(html, "text/html");
        document.querySelectorAll("[data-live-region]").forEach(function (region) {
          var replacement = fresh.getElementById(region.id);
          if (!replacement) return;
          region.replaceWith(replacement);
          if (window.htmx) window.htmx.process(replacement);
        });
        labelCells();
        fitCharts();
      })
      .catch(function () { setTimeout(function () { refreshRegions(reason); }, 2000); })  // server away: again
      .finally(function () {
        refreshing = false;
        if (refreshAgain) { refreshAgain = false; setTimeout(function () { refreshRegions(reason); }, 200); }
      });
  }

  // Fallback only while the socket is down (server restarting, a proxy without websockets): while work is in
  // flight, look again every few seconds. With the socket up, news comes only as pushes.
  setInterval(function () {
    var down = document.body.dataset.live && !socketUp && document.body.dataset.liveConnected !== "refused";
    if (down && document.querySelector("[data-live-pending]")) refreshRegions("poll");
  }, 3000);

  // Phones: the menu button opens the sidebar as a drawer; the scrim, Escape or a link choice closes it.
  function setMenu(open) {
    document.body.classList.toggle("menu-open", open);
    var button = document.querySelector("[data-menu]");
    if (button) button.setAttribute("aria-expanded", open ? "true" : "false");
  }
  document.addEventListener("click", function (event) {
    if (event.target.closest("[data-menu]")) setMenu(!document.body.classList.contains("menu-open"));
    else if (event.target.closest("[data-menu-close]")) setMenu(false);
  });
  document.addEventListener("keydown", function (event) { if (event.key === "Escape") setMenu(false); });

  // Card tables on phones: each cell carries its column's name (from the header) as a label.
  function labelCells(root) {
    (root || document).querySelectorAll("table.table").forEach(function (table) {
      var names = Array.prototype.map.call(table.querySelectorAll("thead th"), function (th) { return th.textContent.replace(/[▲▼]/g, "").trim(); });
      if (!names.length) return;
      table.querySelectorAll("tbody tr").forEach(function (row) {
        Array.prototype.forEach.call(row.children, function (cell, index) {
          if (cell.tagName === "TD" && cell.colSpan === 1) cell.dataset.label = names[index] || "";
        });
      });
    });
  }
  document.addEventListener("htmx:afterSwap", function () { labelCells(); fitCharts(); });

  document.addEventListener("DOMContentLoaded", function () {
    labelCells();
    fitCharts();
    if (document.body.dataset.live) connect(document.body.dataset.live);
    var adapterSelect = document.getElementById("id_adapter");
    if (adapterSelect) toggleNewAdapterFields(adapterSelect);
  });
})();
