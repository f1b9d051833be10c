// loopd's login page: trade the one-time code in this link's fragment for the session
// cookie, then open the status page. The fragment never reaches a server (not in a request
// line, a log or a Referer); it is removed from the address bar and the history first.
"use strict";

(function () {
  const message = document.getElementById("message");
  const code = window.location.hash.slice(1);
  window.history.replaceState(null, "", window.location.pathname);

  function say(text) {
    message.textContent = text;
    message.className = "problem";
  }

  if (!code) {
    say("This link has no login code. Run loopd ui to get one.");
    return;
  }
  fetch("/ui/login", {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify({ code: code }),
    credentials: "same-origin",
    cache: "no-store",
  })
    .then(function (response) {
      if (response.ok) {
        window.location.replace("/");
        return null;
      }
      return response.json().then(function (body) {
        say(body && body.error ? body.error.message : "The login failed (" + response.status + ").");
      });
    })
    .catch(function () {
      say("loopd did not answer. Is it still running?");
    });
})();
