// consumer-kit console: conveniences only; every page works without this script.
"use strict";
document.addEventListener("DOMContentLoaded", () => {
  // "Select all on this page" in a group's list.
  for (const all of document.querySelectorAll("input.select-all")) {
    all.addEventListener("change", () => {
      for (const box of all.closest("form").querySelectorAll('input[type=checkbox][name=id]')) box.checked = all.checked;
    });
  }
  // The overview refreshes itself every 30 s while it is open (the chart, the outbox, the leases).
  if (document.getElementById("outcomes")) {
    setTimeout(() => { if (!document.hidden) window.location.reload(); }, 30000);
  }
});
