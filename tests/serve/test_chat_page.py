"""The chat page used as a person uses it, in headless Chromium (the browser and the stub server of test_ui):
right-to-left text, the keyboard alone, a phone's narrow screen, the settings a user can get wrong. Every test
listens to the page's console and errors, and stops the server it starts."""
import pytest
import test_ui
from test_ui import StubApp, send

browser = test_ui.browser                    # the module's browser and a fresh page per test (console listened to)
page = test_ui.page

DONE = "() => document.querySelectorAll('.msg.assistant .stats')[{}]?.textContent.includes('generated (')"


def open_chat(page, stub) -> None:
    page.goto(stub.url + "/")
    page.wait_for_selector("body[data-ready='1']")


def test_right_to_left_text_reads_right_to_left(page):
    """A message or a reply in Arabic or Hebrew is laid out right to left (its own direction, dir=auto), an
    English one left to right, and so is the text typed in the box."""
    stub = StubApp("مرحبا! كيف يمكنني مساعدتك اليوم؟")
    try:
        open_chat(page, stub)
        send(page, "שלום, מה שלומך?")
        page.wait_for_function(DONE.format(0))
        send(page, "Hello there.")
        page.wait_for_function(DONE.format(1))
        dirs = page.eval_on_selector_all(".msg .body", "es => es.map(e => getComputedStyle(e).direction)")
        assert dirs == ["rtl", "rtl", "ltr", "rtl"], dirs
        page.fill("#input", "שלום")
        assert page.eval_on_selector("#input", "e => getComputedStyle(e).direction") == "rtl"
        page.fill("#input", "hello")
        assert page.eval_on_selector("#input", "e => getComputedStyle(e).direction") == "ltr"
        assert not page.errors, page.errors
    finally:
        stub.stop()


def focused(page) -> str:
    return page.evaluate("document.activeElement.id || document.activeElement.tagName")


def test_keyboard_alone_send_stop_regenerate_keep_the_focus(page):
    """With the keyboard only: Tab to Send and press Enter, Tab to Stop and press Enter, then Regenerate. Each
    button is disabled by its own press; the focus goes back to the message box, not to the page's body (where the
    next Tab would start again from the top)."""
    stub = StubApp("A reply long enough to stop: " + "and on " * 40, delay=0.05)
    try:
        open_chat(page, stub)
        page.focus("#input")
        page.keyboard.type("hello")
        page.keyboard.press("Tab")
        assert focused(page) == "send"
        page.keyboard.press("Enter")
        page.wait_for_function("() => document.querySelector('.msg.assistant .body').textContent.length > 0")
        assert focused(page) == "input"
        page.keyboard.press("Tab")                   # Send is disabled while the reply streams: Stop is next
        assert focused(page) == "stop"
        page.keyboard.press("Enter")
        page.wait_for_function("() => document.querySelector('.msg.assistant .stats').textContent.includes('stopped')")
        assert focused(page) == "input"
        page.keyboard.press("Tab")                   # Send, then (Stop disabled) Regenerate
        page.keyboard.press("Tab")
        assert focused(page) == "regenerate"
        page.keyboard.press("Enter")
        page.wait_for_function("() => document.querySelector('.msg.assistant .body').textContent.length > 0")
        assert focused(page) == "input"
        page.click("#stop")
        assert not page.errors, page.errors
    finally:
        stub.stop()


def test_controls_have_names_and_the_conversation_scrolls_from_the_keyboard(page):
    """Every control has an accessible name of its own (the sliders too, not only their shown values; the message
    box not only a placeholder), and the conversation is a named log that Tab reaches and the keys scroll."""
    stub = StubApp("A long reply.\n" * 200)
    try:
        open_chat(page, stub)
        for role, name in (("slider", "Temperature"), ("slider", "Top-p"), ("spinbutton", "Max tokens"),
                           ("spinbutton", "Seed"), ("textbox", "System prompt"), ("textbox", "Message"),
                           ("button", "Send"), ("button", "Stop")):
            assert page.get_by_role(role, name=name, exact=True).count() == 1, (role, name)
        send(page, "a long one, please")
        page.wait_for_function(DONE.format(0))
        log = page.get_by_role("log", name="Conversation", exact=True)
        assert log.count() == 1
        page.focus("#seed")
        page.keyboard.press("Tab")
        assert focused(page) == "messages"
        top = "document.getElementById('messages').scrollTop"
        assert page.evaluate(top) > 0                # at the end of the reply
        page.keyboard.press("Home")
        page.wait_for_function(f"() => {top} === 0")
        page.keyboard.press("PageDown")
        page.wait_for_function(f"() => {top} > 0")
        page.keyboard.press("Tab")                   # the reply's Copy button, then the box
        assert page.evaluate("document.activeElement.textContent") == "Copy"
        page.keyboard.press("Tab")
        assert focused(page) == "input"
        assert not page.errors, page.errors
    finally:
        stub.stop()


def test_every_button_on_screen_narrow_or_short(browser):
    """At 320 px wide (a small phone) the page does not scroll sideways and every button of the box is on screen;
    at 800 x 600 (a short laptop window, the JSON schema field shown) the page does not scroll at all: the
    conversation and the settings scroll inside it, and the box and its buttons stay in view."""
    stub = StubApp("ok", structured_output=True)
    try:
        for width, height in ((320, 568), (360, 640), (800, 600), (1024, 640)):
            ctx = browser.new_context(viewport={"width": width, "height": height})
            try:
                pg = test_ui.listen(ctx.new_page())
                open_chat(pg, stub)
                assert pg.evaluate("document.documentElement.scrollWidth") <= width, width
                if width > 700:
                    assert pg.evaluate("document.documentElement.scrollHeight") <= height, (width, height)
                for sel in ("#input", "#send", "#stop", "#regenerate", "#clear"):
                    box = pg.locator(sel).bounding_box()
                    assert 0 <= box["x"] and box["x"] + box["width"] <= width, (width, sel, box)
                    assert 0 <= box["y"] and box["y"] + box["height"] <= height, (width, height, sel, box)
                assert not pg.errors, pg.errors
            finally:
                ctx.close()
    finally:
        stub.stop()


def test_a_seed_the_page_cannot_send_exactly_is_refused(page):
    """A seed past 2^53 - 1 would go out as another number (JavaScript's doubles: 9007199254740993 is sent as
    ...992) or as 1e+30, which the server refuses as not an integer: the page says so and sends nothing. The largest
    exact seed goes out as typed."""
    stub = StubApp("ok")
    try:
        open_chat(page, stub)
        for seed in ("9007199254740993", "1e30"):
            page.fill("#seed", seed)
            send(page, "hello")
            page.wait_for_selector("#notice >> text=Seed")
            assert stub.bodies == [] and page.input_value("#input") == "hello", seed
        page.fill("#seed", "9007199254740991")
        page.click("#send")
        page.wait_for_function(DONE.format(0))
        assert stub.bodies[-1]["seed"] == 9007199254740991
        assert not page.errors, page.errors
    finally:
        stub.stop()


def test_stop_before_the_reply_begins_takes_the_message_back(page):
    """Stop before any of the reply came: no empty reply is kept in the conversation (the next request would carry
    an assistant turn the model never wrote); the message goes back in the box, and the page says why. Sending it
    again asks with it alone."""
    stub = StubApp("late but here", delay=1.0)
    try:
        open_chat(page, stub)
        send(page, "hello")
        page.wait_for_selector(".msg.assistant")
        page.click("#stop")
        page.wait_for_selector("#notice >> text=Stopped before the reply began")
        assert page.locator(".msg").count() == 0
        assert page.input_value("#input") == "hello" and page.is_enabled("#send")
        page.click("#send")
        page.wait_for_function(DONE.format(0), timeout=30_000)
        assert stub.bodies[-1]["messages"] == [{"role": "user", "content": "hello"}]
        assert page.locator(".msg .body").all_inner_texts() == ["hello", "late but here"]
        assert page.inner_text("#notice") == ""
        assert not page.errors, page.errors
    finally:
        stub.stop()


def test_enter_while_a_reply_streams_says_why_nothing_was_sent(page):
    """Enter while a reply streams sends nothing (one reply at a time) and says so; the message stays in the box
    and goes with the next Enter once the reply is done, the notice gone."""
    stub = StubApp("a reply that takes a moment " * 4, delay=0.1)
    try:
        open_chat(page, stub)
        send(page, "first")
        page.wait_for_function("() => document.querySelector('.msg.assistant .body').textContent.length > 0")
        page.focus("#input")
        page.keyboard.type("second")
        page.keyboard.press("Enter")
        page.wait_for_selector("#notice >> text=still coming", timeout=2_000)
        assert page.input_value("#input") == "second" and len(stub.bodies) == 1
        page.wait_for_function(DONE.format(0))
        assert page.inner_text("#notice") == ""       # the reply is done: the notice is gone
        page.focus("#input")
        page.keyboard.press("Enter")
        page.wait_for_function(DONE.format(1))
        assert stub.bodies[-1]["messages"][-1] == {"role": "user", "content": "second"}
        assert page.inner_text("#notice") == ""
        assert not page.errors, page.errors
    finally:
        stub.stop()


def test_a_reply_on_its_way_says_so_until_its_first_token(page):
    """While the server has not answered yet (a queue behind other clients, a long prompt), the reply's bubble
    says it waits for the first token, and is marked busy for screen readers until the reply is done."""
    stub = StubApp("here at last", delay=1.5)
    try:
        open_chat(page, stub)
        send(page, "hello")
        page.wait_for_selector(".msg.assistant")
        assert "waiting for the first token" in page.inner_text(".msg.assistant .stats")
        assert page.get_attribute(".msg.assistant", "aria-busy") == "true"
        page.wait_for_function(DONE.format(0), timeout=30_000)
        assert "waiting" not in page.inner_text(".msg.assistant .stats")
        assert page.get_attribute(".msg.assistant", "aria-busy") is None
        assert not page.errors, page.errors
    finally:
        stub.stop()


def test_the_message_box_has_the_focus_on_load_and_after_the_key(browser, page):
    """On a computer the page opens with the focus in the message box (type, Enter); on a phone it does not (its
    keyboard would cover the conversation). A key asked for takes the focus, and gives it back to the box."""
    stub = StubApp("ok")
    phone = browser.new_context(viewport={"width": 375, "height": 667}, is_mobile=True, has_touch=True)
    try:
        open_chat(page, stub)
        assert focused(page) == "input"
        page.keyboard.type("hello")
        page.keyboard.press("Enter")
        page.wait_for_function(DONE.format(0))
        on_phone = test_ui.listen(phone.new_page())
        open_chat(on_phone, stub)
        assert focused(on_phone) == "BODY"
        assert not page.errors and not on_phone.errors, (page.errors, on_phone.errors)
    finally:
        phone.close()
        stub.stop()
    stub = StubApp("ok", api_key="s3cret")
    try:
        page.evaluate("sessionStorage.clear()")
        page.goto(stub.url + "/")
        page.wait_for_selector("#keyform:not([hidden])")
        assert page.evaluate("document.activeElement === document.querySelector('#keyform input')")
        page.keyboard.type("s3cret")
        page.keyboard.press("Enter")
        page.wait_for_selector("body[data-ready='1']")
        assert focused(page) == "input"
        assert all("401" in e for e in page.errors), page.errors
    finally:
        stub.stop()


def test_a_page_whose_info_fails_says_so_and_catches_up(page):
    """The page came but its /ui/info did not (the server went down meanwhile, or answered 500): no uncaught error,
    the header says the server is not answering, and once it answers the model's name and limits come in."""
    stub = StubApp("ok")
    failed = []

    def fail_twice(route):
        failed.append(route.request.url)
        if len(failed) == 1:
            route.abort()                             # no answer
        elif len(failed) == 2:
            route.fulfill(status=500, body="down")
        else:
            route.continue_()
    try:
        page.route("**/ui/info", fail_twice)
        page.goto(stub.url + "/")
        page.wait_for_selector("#model >> text=not answering")
        page.wait_for_selector("body[data-ready='1']", timeout=15_000)
        assert page.inner_text("#model") == "stub" and len(failed) == 3
        assert not [e for e in page.errors if "ERR_FAILED" not in e and "500" not in e], page.errors
    finally:
        stub.stop()


def test_on_a_phone_enter_is_a_new_line_and_send_sends(browser):
    """A phone's keyboard has no Shift+Enter: there Enter makes a new line (a message of several lines can be
    typed) and the Send button sends; the box's hint says so. On a computer Enter sends (the other tests)."""
    stub = StubApp("ok")
    ctx = browser.new_context(viewport={"width": 375, "height": 667}, is_mobile=True, has_touch=True)
    try:
        pg = test_ui.listen(ctx.new_page())
        open_chat(pg, stub)
        assert "Shift+Enter" not in (pg.get_attribute("#input", "placeholder") or "")
        pg.tap("#input")
        pg.keyboard.type("first line")
        pg.keyboard.press("Enter")
        pg.keyboard.type("second line")
        assert pg.input_value("#input") == "first line\nsecond line" and stub.bodies == []
        pg.tap("#send")
        pg.wait_for_function(DONE.format(0))
        assert stub.bodies[-1]["messages"] == [{"role": "user", "content": "first line\nsecond line"}]
        assert not pg.errors, pg.errors
    finally:
        ctx.close()
        stub.stop()


REPLY_WITH_CODE = "Here:\n```python\ndef f(x):\n    return x * 2  # <b>not bold</b>\n```\n"


@pytest.mark.parametrize("clipboard_api", [True, False])
def test_copy_puts_the_reply_exactly_on_the_clipboard(browser, clipboard_api):
    """Each reply has a Copy button (reached by Tab, like any button) that puts the reply's text on the clipboard
    exactly as the model wrote it: code's indentation and newlines kept, no "assistant" label, no stats line. Where
    the page has no clipboard API (served over plain http to another machine) it copies through a selection."""
    stub = StubApp(REPLY_WITH_CODE)
    ctx = browser.new_context()
    try:
        ctx.grant_permissions(["clipboard-read", "clipboard-write"], origin=stub.url)
        if not clipboard_api:
            ctx.add_init_script("Object.defineProperty(navigator, 'clipboard', {value: undefined});")
        pg = test_ui.listen(ctx.new_page())
        open_chat(pg, stub)
        send(pg, "some code")
        pg.wait_for_function(DONE.format(0))
        copy = pg.get_by_role("button", name="Copy", exact=True)
        assert copy.count() == 1                      # on the reply, not on the user's message
        copy.focus()
        pg.keyboard.press("Enter")
        pg.wait_for_selector(".msg.assistant >> text=Copied")
        pg.fill("#input", "")
        pg.focus("#input")
        pg.keyboard.press("Control+V")
        assert pg.input_value("#input") == REPLY_WITH_CODE
        assert not pg.errors, pg.errors
    finally:
        ctx.close()
        stub.stop()


CONTRAST = """(sel) => [...document.querySelectorAll(sel)].map((e) => {
  const rgb = (c) => c.match(/[\\d.]+/g).slice(0, 3).map(Number);
  const lum = (c) => { const [r, g, b] = rgb(c).map((x) => { x /= 255;
    return x <= 0.03928 ? x / 12.92 : ((x + 0.055) / 1.055) ** 2.4; }); return 0.2126 * r + 0.7152 * g + 0.0722 * b; };
  let bg = e, back = 'rgba(0, 0, 0, 0)';
  while (bg && (back = getComputedStyle(bg).backgroundColor) === 'rgba(0, 0, 0, 0)') bg = bg.parentElement;
  if (!bg) back = 'rgb(255, 255, 255)';
  const [a, b] = [lum(getComputedStyle(e).color), lum(back)].sort((x, y) => y - x);
  return [e.className || e.id || e.tagName, (a + 0.05) / (b + 0.05)];
})"""


def test_small_grey_text_is_readable(page):
    """The small grey text (who wrote a message, the stats line, the model's name, the key form's note) has at
    least WCAG AA's 4.5:1 contrast with what it sits on, the user's blue bubble included."""
    stub = StubApp("ok")
    try:
        open_chat(page, stub)
        send(page, "hello")
        page.wait_for_function(DONE.format(0))
        low = [(name, round(r, 2)) for sel in (".msg .who", ".msg .stats", ".dim", "#notice")
               for name, r in page.evaluate(CONTRAST, sel) if r < 4.5]
        assert not low, low
    finally:
        stub.stop()


def _stream_layout_s(browser, lines: int) -> tuple[float, dict]:
    """Stream a reply of `lines` lines (and a blank line after every third), 7 characters a piece 2 ms apart, into a
    fresh page: the seconds Chromium spent in layout meanwhile, and the reply's text and look against one block
    holding the same text."""
    text = "".join(f"line {i:5d} of a long reply, some words\n" + "\n" * (i % 3 == 0) for i in range(lines))
    stub = StubApp(text, delay=0.002)
    ctx = browser.new_context()
    try:
        pg = test_ui.listen(ctx.new_page())
        cdp = ctx.new_cdp_session(pg)
        cdp.send("Performance.enable")
        open_chat(pg, stub)
        before = {x["name"]: x["value"] for x in cdp.send("Performance.getMetrics")["metrics"]}["LayoutDuration"]
        send(pg, "long")
        pg.wait_for_function(DONE.format(0), timeout=120_000)
        after = {x["name"]: x["value"] for x in cdp.send("Performance.getMetrics")["metrics"]}["LayoutDuration"]
        look = pg.eval_on_selector(".msg.assistant .body", """(b) => {
          const one = document.createElement('div');
          one.className = 'body';
          one.textContent = b.textContent;
          b.after(one);
          const r = {text: b.textContent, height: b.offsetHeight, one: one.offsetHeight};
          one.remove();
          return r;
        }""")
        assert look["text"] == text and not pg.errors, pg.errors
        return after - before, look
    finally:
        ctx.close()
        stub.stop()


def test_a_long_reply_is_not_laid_out_again_at_every_piece(browser):
    """Each piece of a streamed reply costs layout for the end of the reply only, not for all of it: eight times
    the text costs about eight times the layout (it was the square: 37 times here), and the reply looks as one block
    of the same text would."""
    short, _ = _stream_layout_s(browser, 100)
    long, look = _stream_layout_s(browser, 800)
    print(f"layout: {short:.3f} s for 100 lines, {long:.3f} s for 800 lines ({long / short:.1f} x)")
    assert look["height"] == look["one"], look
    assert long < 24 * short, (short, long)


def test_a_bad_json_schema_is_said_where_the_message_is(browser):
    """A JSON schema that does not parse is refused: on a phone its field is out of sight, under the conversation,
    so the notice over the message box says so too (not a Send that seems to do nothing)."""
    stub = StubApp('{"a": 1}', structured_output=True)
    ctx = browser.new_context(viewport={"width": 375, "height": 667})
    try:
        pg = test_ui.listen(ctx.new_page())
        open_chat(pg, stub)
        pg.fill("#schema", "{not json")
        send(pg, "a json please")
        pg.wait_for_selector("#notice >> text=JSON schema")
        box = pg.locator("#notice").bounding_box()
        assert 0 <= box["y"] and box["y"] + box["height"] <= 667, box
        assert "Nothing was sent" in pg.inner_text("#notice") and stub.bodies == []
        assert pg.input_value("#input") == "a json please"
        pg.fill("#schema", '{"type": "object"}')
        pg.click("#send")
        pg.wait_for_function(DONE.format(0))
        assert pg.inner_text("#notice") == "" and pg.inner_text("#schema-error") == ""
        assert not pg.errors, pg.errors
    finally:
        ctx.close()
        stub.stop()


def test_a_reload_mid_reply_says_the_message_is_back_in_the_box(page):
    """Reloaded while a reply streams: the conversation before it comes back, the unanswered message is back in
    the box, and the notice says why it is there (not an unexplained draft)."""
    stub = StubApp("a slow reply " * 30, delay=0.1)
    try:
        open_chat(page, stub)
        send(page, "hello")
        page.wait_for_function("() => document.querySelector('.msg.assistant .body').textContent.length > 0")
        page.reload()
        page.wait_for_selector("body[data-ready='1']")
        assert page.locator(".msg").count() == 0 and page.input_value("#input") == "hello"
        assert "did not finish" in page.inner_text("#notice")
        assert not page.errors, page.errors
    finally:
        stub.stop()


def test_each_page_marks_itself_in_the_header(page):
    """The header's links say which page this is (aria-current=page), for a screen reader and in bold."""
    stub = StubApp("ok")
    try:
        for path, here, other in (("/", "chat", "dashboard"), ("/dashboard", "dashboard", "chat")):
            page.goto(stub.url + path)
            assert page.get_by_role("link", name=here, exact=True).get_attribute("aria-current") == "page"
            assert page.get_by_role("link", name=other, exact=True).get_attribute("aria-current") is None
            weight = page.eval_on_selector("[aria-current=page]", "e => getComputedStyle(e).fontWeight")
            assert int(weight) >= 600, weight
        assert not page.errors, page.errors
    finally:
        stub.stop()


def test_a_regenerate_that_fails_keeps_the_reply_it_was_to_replace(page):
    """Regenerate with the server gone (or Stop before the new reply's first token): the reply it was to replace
    stays, in the page and in the conversation, the user's message stays where it was (not moved back into the
    box), and the notice says why nothing changed."""
    stub = StubApp("the first reply", delay=0.3)
    try:
        open_chat(page, stub)
        send(page, "hello")
        page.wait_for_function(DONE.format(0))
        page.click("#regenerate")                     # Stop before the first token (0.3 s away)
        page.click("#stop")
        page.wait_for_selector("#notice >> text=previous reply is kept")
        assert page.locator(".msg .body").all_inner_texts() == ["hello", "the first reply"]
        assert page.input_value("#input") == ""
    finally:
        stub.stop()
    page.click("#regenerate")                         # the server is gone
    page.wait_for_selector("#notice >> text=could not be reached")
    assert "previous reply is kept" in page.inner_text("#notice")
    assert page.locator(".msg .body").all_inner_texts() == ["hello", "the first reply"]
    assert page.input_value("#input") == "" and page.is_enabled("#regenerate")
    assert page.evaluate("JSON.parse(sessionStorage.getItem('lumen-chat')).history") == [
        {"role": "user", "content": "hello"}, {"role": "assistant", "content": "the first reply"}]
    assert all("ERR_CONNECTION_REFUSED" in e for e in page.errors), page.errors
