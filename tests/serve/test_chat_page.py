"""The chat page used as a person uses it, in headless Chromium (the browser and the stub server of test_ui):
right-to-left text, the keyboard alone, a phone's narrow screen, the settings a user can get wrong. Every test
listens to the page's console and errors, and stops the server it starts."""
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
