/* The chat page: messages go to POST /v1/chat/completions (stream: true) and the reply is read as server-sent
   events. Model output is only ever put into the page as text (textContent / text nodes), never as HTML. */
"use strict";

const $ = (id) => document.getElementById(id);
const history = [];          // {role, content} of the conversation, without the system prompt
let controller = null;       // the AbortController of the reply in flight
let conversation = 0;        // counts the Clears: a reply cut by one does not go into the new conversation
let structured = false;      // the server honours response_format json_schema (GET /ui/info)
const SAVED = "lumen-chat";  // this tab's conversation and settings in sessionStorage: a reload keeps them
const FIELDS = ["system", "temperature", "top_p", "max_tokens", "seed", "schema"];
const STOPPED = {};          // reply()'s answer when Stop came before any of the reply
const BUSY = "A reply is still coming: wait for it, or press Stop. The message stays in the box.";
const BLOCK_CHARS = 1000;    // a reply's text is laid out in blocks of about this many characters (grower)
const PHONE = matchMedia("(pointer: coarse)").matches;   // a touch screen: its keyboard has no Shift+Enter

function save() {
  const settings = {};
  for (const id of FIELDS) settings[id] = $(id).value;
  try { sessionStorage.setItem(SAVED, JSON.stringify({history, settings})); } catch (e) { /* full, or off */ }
}

/* The conversation and settings saved by this tab before a reload; a last user turn whose reply never came
   goes back in the box. */
function restore() {
  let saved = null;
  try { saved = JSON.parse(sessionStorage.getItem(SAVED) || "null"); } catch (e) { /* off, or not ours */ }
  if (!saved || typeof saved !== "object") return;
  for (const id of FIELDS) {
    const v = saved.settings && saved.settings[id];
    if (typeof v === "string") $(id).value = v;
  }
  const turns = (Array.isArray(saved.history) ? saved.history : []).filter((t) => t &&
    (t.role === "user" || t.role === "assistant") && typeof t.content === "string");
  if (turns.length && turns[turns.length - 1].role === "user") {
    $("input").value = turns.pop().content;
    $("notice").textContent = "The reply to this message did not finish before the page was reloaded. " +
      "The message is back in the box.";
  }
  for (const t of turns) {
    history.push(t);
    addMessage(t.role, t.content);
  }
}

function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  const who = document.createElement("div");
  who.className = "who";
  who.textContent = role;
  const body = document.createElement("div");
  body.className = "body";
  body.dir = "auto";                           // Arabic or Hebrew reads right to left, by its first strong letter
  body.textContent = text || "";
  const stats = document.createElement("div");
  stats.className = "stats";
  stats.title = "measured in this page: TTFT from sending the request to the first token's arrival";
  if (role === "assistant") {
    const copy = document.createElement("button");
    copy.type = "button";
    copy.className = "copy";
    copy.textContent = "Copy";
    copy.addEventListener("click", () => copyText(body, copy));
    who.append(" ", copy);
  }
  div.append(who, body, stats);
  $("messages").append(div);
  $("messages").scrollTop = $("messages").scrollHeight;
  return {div, body, stats};
}

/* Put a reply's text on the clipboard, exactly: the clipboard API where the page has it (https, or this machine),
   else the copy command on a hidden box holding the text (plain http from another machine). */
async function copyText(body, button) {
  let ok = false;
  try {
    if (navigator.clipboard) { await navigator.clipboard.writeText(body.textContent); ok = true; }
  } catch (e) { /* refused: the copy command below */ }
  if (!ok) {
    const area = document.createElement("textarea");
    area.className = "offscreen";
    area.value = body.textContent;
    document.body.append(area);
    area.select();
    ok = document.execCommand("copy");
    area.remove();
    button.focus();
  }
  button.textContent = ok ? "Copied" : "Copy failed";
  setTimeout(() => { button.textContent = "Copy"; }, 1500);
}

/* The buttons for a reply streaming (busy) or not. A button that its own press disables hands the focus to the
   message box, so that keyboard use goes on from there rather than from the top of the page. */
function setBusy(busy) {
  const had = document.activeElement;
  $("send").disabled = busy;
  $("stop").disabled = !busy;
  $("regenerate").disabled = busy || !history.some((m) => m.role === "assistant");
  if (had && had.disabled) $("input").focus();
}

function params() {
  const p = {temperature: Number($("temperature").value), top_p: Number($("top_p").value),
             max_tokens: Math.max(1, Math.floor(Number($("max_tokens").value) || 256))};
  const seed = $("seed").value.trim();
  if (seed !== "") p.seed = Math.floor(Number(seed));
  return p;
}

/* What is wrong with a setting the browser can check (a max tokens of 0 or 2.5, a negative seed, a seed over
   2^53 - 1: the largest integer a JavaScript number holds exactly, so the seed sent is the seed typed), or "" */
function badSetting() {
  for (const [id, label] of [["max_tokens", "Max tokens"], ["seed", "Seed"]]) {
    const el = $(id);
    if (!el.validity.valid) return `${label}: ${el.validationMessage || "not a valid value"} Nothing was sent.`;
  }
  return "";
}

/* The optional JSON schema as a response_format, or null; throws with a message on bad JSON. */
function responseFormat() {
  if (!structured) return null;
  const text = $("schema").value.trim();
  $("schema-error").textContent = "";
  if (!text) return null;
  let schema;
  try { schema = JSON.parse(text); } catch (e) { $("schema-error").textContent = "not JSON: " + e.message; throw e; }
  return {type: "json_schema", json_schema: {name: "schema", schema: schema}};
}

/* A schema that does not parse, said over the message box too: on a phone its field is out of sight. */
function refuseSchema(e) {
  $("notice").textContent = `JSON schema: not JSON (${e.message}). Nothing was sent.`;
}

/* lumen.generate's stats line, measured here: TTFT from sending to the first token's chunk. */
function statsLine(s) {
  const gen = s.completion, dec = s.tLast - s.tFirst;
  const parts = [];
  if (s.prompt != null) parts.push(`prompt ${s.prompt} tok`);
  if (s.tFirst != null) {
    const ttft = s.tFirst - s.t0;
    parts.push(`TTFT ${ttft.toFixed(0)} ms`);
    if (s.prompt != null && ttft > 0) parts.push(`prefill ${(s.prompt / ttft * 1e3).toFixed(1)} tok/s`);
    if (gen > 1 && dec > 0) {
      parts.push(`decode ${((gen - 1) / dec * 1e3).toFixed(1)} tok/s`);
      parts.push(`TPOT ${(dec / (gen - 1)).toFixed(1)} ms`);
    }
  }
  parts.push(`${gen} generated (${s.finish || "?"})`);
  return parts.join(" | ");
}

/* A function that adds text at the end of a reply's body, in blocks of about BLOCK_CHARS that each end after a
   line break: the browser then lays out only the last block as text comes, not the whole reply at every piece (a
   long reply's layout time grew with the square of its length). A line break that ends a block shows as it would
   inside one, so the reply looks the same, and its textContent is the reply exactly. */
function grower(body) {
  let text = null;
  const open = (data) => {
    const block = document.createElement("div");
    block.className = "part";
    text = document.createTextNode(data);
    block.append(text);
    body.append(block);
  };
  open("");
  return (delta) => {
    text.appendData(delta);
    if (text.length < BLOCK_CHARS) return;
    const cut = text.data.lastIndexOf("\n") + 1;
    if (cut === 0) return;                                     // one long line so far: the block goes on
    const rest = text.data.slice(cut);
    text.deleteData(cut, text.length - cut);
    open(rest);
  };
}

/* Ask for the reply to the conversation in `history` (it ends with the user's turn). Resolves to null, or to the
   error when the request failed before any of the reply came (refused, or the server unreachable), or to STOPPED
   when Stop came first: its bubble is gone, and the caller takes the user's turn back out (send: so that one bad
   message does not fail every later one, and no empty reply the model never wrote goes into the conversation) or
   puts back the reply it was to replace (regenerate). */
async function reply(fmt) {
  const messages = [];
  const system = $("system").value.trim();
  if (system) messages.push({role: "system", content: system});
  messages.push(...history);
  const body = Object.assign({messages, stream: true, stream_options: {include_usage: true}}, params());
  if (fmt) body.response_format = fmt;
  const view = addMessage("assistant", "");
  const grow = grower(view.body);
  view.stats.textContent = "waiting for the first token…";   // a queue or a long prompt can take seconds
  view.div.setAttribute("aria-busy", "true");                  // screen readers: read the reply once it is done
  const mine = conversation;
  const s = {t0: performance.now(), tFirst: null, tLast: null, completion: 0, prompt: null, finish: null};
  controller = new AbortController();
  setBusy(true);
  $("notice").textContent = "";
  let content = "", failure = null;
  try {
    const r = await keyedFetch("/v1/chat/completions", {method: "POST", body: JSON.stringify(body),
      headers: {"Content-Type": "application/json"}, signal: controller.signal});
    if (!r.ok) {
      let msg = `HTTP ${r.status}`;
      try { msg += ": " + (await r.json()).error.message; } catch (e) { /* not JSON */ }
      throw new Error(msg);
    }
    const reader = r.body.getReader();
    const decoder = new TextDecoder();
    let buf = "";
    for (;;) {
      const {value, done} = await reader.read();
      if (done) break;
      buf += decoder.decode(value, {stream: true});
      const m = $("messages");
      const atEnd = m.scrollHeight - m.scrollTop - m.clientHeight < 40;      // the reader follows the reply
      let cut;
      while ((cut = buf.indexOf("\n\n")) >= 0) {
        const event = buf.slice(0, cut);
        buf = buf.slice(cut + 2);
        for (const line of event.split("\n")) {
          if (!line.startsWith("data:")) continue;
          const data = line.slice(5).trim();
          if (data === "[DONE]") continue;
          const chunk = JSON.parse(data);
          if (chunk.error) throw new Error(chunk.error.message);
          if (chunk.usage) { s.prompt = chunk.usage.prompt_tokens; s.completion = chunk.usage.completion_tokens; }
          for (const c of chunk.choices || []) {
            const delta = (c.delta && c.delta.content) || "";
            if (delta) {
              const now = performance.now();
              if (s.tFirst == null) { s.tFirst = now; view.stats.textContent = ""; }
              s.tLast = now;
              content += delta;
              grow(delta);                          // text, never HTML
              if (!s.prompt) s.completion += 1;     // until the usage chunk gives the count
            }
            if (c.finish_reason) s.finish = c.finish_reason;
          }
        }
      }
      if (atEnd) m.scrollTop = m.scrollHeight;
    }
  } catch (e) {
    if (e.name === "AbortError") {
      s.finish = "stopped";
      if (!content) failure = STOPPED;
    } else {
      failure = String(e.message || e);
      if (e instanceof TypeError)                  // fetch's network failures: no answer, or the stream cut
        failure = content ? `the connection to the server was lost (${failure})` :
          `the server could not be reached (${failure}); is it running?`;
      s.finish = "error";
    }
  } finally {
    controller = null;
    view.div.removeAttribute("aria-busy");
    view.stats.textContent = statsLine(s);
    if ($("notice").textContent === BUSY) $("notice").textContent = "";        // the reply is done now
  }
  if (mine !== conversation || (failure && !content)) {
    setBusy(false);
    if (mine !== conversation) return null;        // cleared meanwhile: nothing to keep
    view.div.remove();
    return failure;
  }
  if (failure) {                                   // cut short: what came is kept, with why it stopped
    const err = document.createElement("div");
    err.className = "error";
    err.textContent = failure;
    view.div.append(err);
  }
  history.push({role: "assistant", content});
  save();
  setBusy(false);
  return null;
}

/* The user's last turn was not answered: out of the history and the page, its text back in the box, and why. */
function unsend(failure) {
  const turn = history.pop();
  save();
  const users = $("messages").querySelectorAll(".msg.user");
  users[users.length - 1].remove();
  if (!$("input").value) $("input").value = turn.content;
  $("notice").textContent = failure === STOPPED ? "Stopped before the reply began. The message is back in the box." :
    `Not sent: ${failure}${/[.?!]$/.test(failure) ? "" : "."} The message is back in the box.`;
  setBusy(false);
}

function send(ev) {
  ev.preventDefault();
  const text = $("input").value;
  if (!text.trim()) return;
  if (controller) {                                            // one reply at a time; the message stays in the box
    $("notice").textContent = BUSY;
    return;
  }
  $("notice").textContent = badSetting();
  if ($("notice").textContent) return;                         // the message stays in the box
  let fmt;
  try { fmt = responseFormat(); } catch (e) { return refuseSchema(e); }    // the message stays in the box
  $("input").value = "";
  history.push({role: "user", content: text});
  save();
  addMessage("user", text);
  reply(fmt).then((failure) => failure && unsend(failure));
}

function regenerate() {
  if (controller) return;
  const last = history.length - 1;
  if (last < 0 || history[last].role !== "assistant") return;
  $("notice").textContent = badSetting();
  if ($("notice").textContent) return;
  let fmt;
  try { fmt = responseFormat(); } catch (e) { return refuseSchema(e); }
  const turn = history.pop();
  const msgs = $("messages").querySelectorAll(".msg.assistant");
  const div = msgs[msgs.length - 1];
  div.remove();
  reply(fmt).then((failure) => failure && keep(failure, turn, div));
}

/* A new reply did not come (refused, the server unreachable, or Stop before its first token): the reply it was to
   replace goes back, in the conversation and the page, and the notice says why nothing changed. */
function keep(failure, turn, div) {
  history.push(turn);
  save();
  $("messages").append(div);
  $("notice").textContent = failure === STOPPED ? "Stopped before the new reply began: the previous reply is kept." :
    `Not regenerated: ${failure}${/[.?!]$/.test(failure) ? "" : "."} The previous reply is kept.`;
  setBusy(false);
}

async function init() {
  restore();
  for (const id of FIELDS) $(id).addEventListener("input", save);
  for (const id of ["temperature", "top_p"]) {
    const show = () => { $(id + "-v").textContent = $(id).value; };
    $(id).addEventListener("input", show);
    show();
  }
  $("composer").addEventListener("submit", send);
  if (PHONE) $("input").placeholder = "Message (Enter: new line)";              // and the Send button sends
  $("input").addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing && !PHONE) {
      ev.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => controller && controller.abort());
  $("regenerate").addEventListener("click", regenerate);
  $("clear").addEventListener("click", () => {
    if (controller) controller.abort();
    conversation += 1;
    history.length = 0;
    save();
    $("notice").textContent = "";
    $("messages").replaceChildren();
    setBusy(false);
  });
  setBusy(false);
  if (!PHONE) $("input").focus();          // a computer: type at once (a phone's keyboard would cover the chat)
  await loadInfo();
  document.body.dataset.ready = "1";
}

/* The model's name and limits (GET /ui/info), asked again every 2 s until the server answers: the page may have
   come while the server went down. */
async function loadInfo() {
  for (;;) {
    try {
      const r = await keyedFetch("/ui/info");
      if (!r.ok) throw new Error(`HTTP ${r.status}`);
      const info = await r.json();
      $("model").textContent = info.model;
      structured = !!info.structured_output;
      $("structured").hidden = !structured;
      if (info.max_model_len) $("max_tokens").max = info.max_model_len;
      return;
    } catch (e) {
      $("model").textContent = "(the server is not answering; trying again)";
      await new Promise((ok) => setTimeout(ok, 2000));
    }
  }
}

init();
