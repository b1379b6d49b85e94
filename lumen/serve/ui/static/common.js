/* Shared by both pages: the API key of this tab and fetch with it.
   The key lives in sessionStorage (this tab only, gone when it closes); it is asked for after a 401. */
"use strict";
const KEY_NAME = "lumen-api-key";

function apiKey() {
  try { return sessionStorage.getItem(KEY_NAME) || ""; } catch (e) { return window.__lumenKey || ""; }
}

function setApiKey(k) {
  try { sessionStorage.setItem(KEY_NAME, k); } catch (e) { window.__lumenKey = k; }
}

function authHeaders(extra) {
  const h = Object.assign({}, extra || {});
  const k = apiKey();
  if (k) h["Authorization"] = "Bearer " + k;
  return h;
}

/* Show the key form (an element #keyform with an input and a button); resolves once a key is entered. Every
   request refused meanwhile waits for that same key (one form, one promise). The form takes the focus and gives it
   back to where it was (the chat's message box) once the key is in. */
let asking = null;

function askKey(message) {
  const form = document.getElementById("keyform");
  const input = form.querySelector("input");
  form.querySelector(".why").textContent = message || "This server needs an API key.";
  if (asking) return asking;
  const back = document.activeElement;
  form.hidden = false;
  input.value = "";
  input.focus();
  asking = new Promise((resolve) => {
    form.onsubmit = (ev) => {
      ev.preventDefault();
      setApiKey(input.value.trim());
      form.hidden = true;
      if (back && back !== document.body && back.isConnected) back.focus();
      asking = null;
      resolve();
    };
  });
  return asking;
}

/* fetch with the key; on 401 ask for it and try again (init.signal aborts the wait for it too). */
async function keyedFetch(url, init) {
  for (;;) {
    const opts = Object.assign({}, init || {});
    opts.headers = authHeaders(opts.headers);
    const r = await fetch(url, opts);
    if (r.status !== 401) return r;
    const ask = askKey(apiKey() ? "That API key was refused; enter it again." : "This server needs an API key.");
    await new Promise((resolve, reject) => {         // or give up when the caller aborts (Stop) meanwhile
      ask.then(resolve);
      if (opts.signal) opts.signal.addEventListener("abort", () => reject(new DOMException("aborted", "AbortError")),
                                                    {once: true});
    });
  }
}
