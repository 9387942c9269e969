"""End to end in a real headless Chromium: log in, open the dead letters, replay one, see a worker process it.

The browser is the system's Chromium driven by Selenium (``DBQUEUE_CHROMIUM``
and ``DBQUEUE_CHROMEDRIVER`` override the Debian paths); the worker is a
real ``runqueueworker`` process. With ``DBQUEUE_SCREENSHOT=path.png`` the
test also saves the queues' overview page there (docs/images/overview.png
is made so).

The breadcrumbs test is not marked slow, so that it runs on every Django the
suite covers (5.2 and 6.1 mark breadcrumbs up differently); it saves a
screenshot per page, named by page and Django version, in its tmp_path or
in ``DBQUEUE_SCREENSHOT_DIR``.
"""

import os
import shutil
import signal
from datetime import timedelta
from pathlib import Path

import django
import pytest
from django.contrib.auth.models import User
from django.utils import timezone

import django_dbqueue
from django_dbqueue.models import ArchivedMessage, Message, Outcome
from tests.support.factories import ArchivedMessageFactory, MessageFactory, WorkerFactory
from tests.support.processes import read_marks, start_worker, wait_for

pytestmark = pytest.mark.django_db(transaction=True)

CHROMIUM = os.environ.get("DBQUEUE_CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("DBQUEUE_CHROMEDRIVER", "/usr/bin/chromedriver")
XSS = "<script>window.dbqueueXss = 1</script>"


def unavailable(why: str) -> None:
    """On CI a missing browser is a failure; on a developer's machine, a skip that says why."""
    if os.environ.get("CI"):
        pytest.fail(why)
    pytest.skip(why)


@pytest.fixture
def browser(tmp_path):
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        unavailable("selenium is not installed (pip install django-dbqueue[test])")
    for binary in (CHROMIUM, CHROMEDRIVER):
        if not shutil.which(binary):
            unavailable(f"{binary} not found: install Debian's chromium and chromium-driver, or set DBQUEUE_CHROMIUM")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        "--window-size=1400,1100",
        f"--user-data-dir={tmp_path / 'chromium-profile'}",
    ):
        options.add_argument(argument)
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    driver.implicitly_wait(10)
    yield driver
    driver.quit()


def navigate(driver, element) -> None:
    """Click something that loads a page, and wait until the old page is gone.

    Without the waits, the next lookup can read the page being left (its
    message list, its rows), or a page still loading, on a slow machine.
    """
    from selenium.common.exceptions import WebDriverException
    from selenium.webdriver.support.ui import WebDriverWait

    old = driver.find_element("tag name", "html")

    def gone(_) -> bool:
        # Stale, or, from Chromium while its document is being replaced, "Node with given id does not
        # belong to the document": a WebDriverException that is not StaleElementReferenceException.
        try:
            old.is_enabled()
        except WebDriverException:
            return True
        return False

    element.click()
    WebDriverWait(driver, 60).until(gone)
    # The old page is gone; wait for the new one to finish loading too, or an
    # element found now may belong to a document still being replaced.
    WebDriverWait(driver, 60).until(lambda d: d.execute_script("return document.readyState") == "complete")


def text_of(driver, css: str) -> str:
    return driver.find_element("css selector", css).text


def log_in(driver, live_server, next_path: str) -> None:
    User.objects.create_superuser("ops", "ops@example.com", "a-long-password")
    driver.get(f"{live_server.url}/admin/login/?next={next_path}")
    driver.find_element("id", "id_username").send_keys("ops")
    driver.find_element("id", "id_password").send_keys("a-long-password")
    navigate(driver, driver.find_element("css selector", "input[type=submit]"))


@pytest.mark.slow
def test_replay_a_dead_letter_and_watch_a_worker_process_it(browser, live_server, tmp_path):
    django_dbqueue.enqueue("w-ok", {"to": "ada@example.com", "note": XSS}, kind="welcome")
    [message] = Message.objects.claim("w-ok")
    message.fail(f"ValueError: the mail server said no {XSS}", retry=False)
    dead = ArchivedMessage.objects.dead().get()

    marks = tmp_path / "marks"
    worker = start_worker("w-ok", "--max-runtime", "300", marks=marks)
    try:
        log_in(browser, live_server, "/admin/django_dbqueue/deadletter/")
        assert "ValueError: the mail server said no" in text_of(browser, "#result_list")
        detail_link = browser.find_element("css selector", f'#result_list a[href$="/deadletter/{dead.pk}/change/"]')
        navigate(browser, detail_link)

        # The detail page: payload pretty-printed, the error in full, and the markup inert.
        assert '"to": "ada@example.com"' in text_of(browser, "pre.dbqueue-json")
        assert XSS in text_of(browser, "pre.dbqueue-error")
        assert browser.execute_script("return window.dbqueueXss") is None

        navigate(browser, browser.find_element("css selector", "button[name=replay]"))
        assert "1 replayed." in text_of(browser, "ul.messagelist")
        dead.refresh_from_db()
        assert dead.replayed_by == "ops" and dead.replayed_as is not None

        # The worker, a separate process, takes the new message; the dead letter's link follows it.
        def acked_in_browser():
            browser.get(f"{live_server.url}/admin/django_dbqueue/deadletter/{dead.pk}/change/")
            navigate(browser, browser.find_element("link text", f"message {dead.replayed_as}"))
            return "archived" in browser.current_url or "/archivedmessage/" in browser.current_url

        wait_for(acked_in_browser, timeout=120, interval=0.5, what="the worker to process the replay")
        assert "Acked" in text_of(browser, "#result_list")
        assert [(event, pk) for event, pk, _ in read_marks(marks)] == [("done", dead.replayed_as)]
        assert read_marks(marks)[0][2] == worker.pid
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.communicate(timeout=120)
    assert worker.returncode == 0
    assert ArchivedMessage.objects.get(message_id=dead.replayed_as).outcome == Outcome.ACKED


def history(now) -> None:
    """A day of finished messages in three queues, some live ones and two workers: the overview's picture."""
    rows = []
    for hour in range(24):
        for queue, per_hour, dead_every in (("emails", 6, 9), ("invoices", 3, 0), ("webhooks", 4, 3)):
            for n in range(per_hour + (hour * 7) % 5):
                dead = bool(dead_every) and (hour + n) % dead_every == 0
                at = now - timedelta(hours=hour, minutes=n * 5)
                rows.append(
                    ArchivedMessageFactory.build(
                        queue=queue,
                        outcome=Outcome.DEAD if dead else Outcome.ACKED,
                        finished_at=at,
                        claimed_at=at - timedelta(seconds=1),
                        created_at=at - timedelta(seconds=3),
                    )
                )
    ArchivedMessage.objects.bulk_create(rows)
    for n in range(7):
        MessageFactory(queue="emails", created_at=now - timedelta(minutes=3 + n))
    MessageFactory(queue="webhooks", scheduled=True)
    WorkerFactory(name="web-1:4242:a1b2c3", hostname="web-1", queues=["emails", "webhooks"], processed=1234)
    WorkerFactory(name="web-2:977:d4e5f6", hostname="web-2", queues=["invoices"], stale=True, processed=87)


@pytest.mark.slow
def test_overview_page_pause_and_resume(browser, live_server, settings, monkeypatch):
    # Only this test's queues: none from the test settings or the test app's handlers.
    settings.DBQUEUE = {}
    monkeypatch.setattr("django_dbqueue.handlers._registry", {})
    history(timezone.now())
    log_in(browser, live_server, "/admin/django_dbqueue/")
    navigate(browser, browser.find_element("link text", "Queues"))
    rows = browser.find_elements("css selector", "#queues tbody tr")
    assert [row.get_attribute("data-queue") for row in rows] == ["emails", "invoices", "webhooks"]
    assert len(browser.find_elements("css selector", "#queues svg.dbqueue-chart rect")) > 3 * 24
    assert "stale" in text_of(browser, "#workers") and "alive" in text_of(browser, "#workers")
    emails = browser.find_element("css selector", 'tr[data-queue="emails"]')
    assert emails.find_elements("css selector", "td")[0].text == "7"  # ready
    if path := os.environ.get("DBQUEUE_SCREENSHOT"):
        browser.save_screenshot(path)
    navigate(browser, browser.find_element("css selector", 'tr[data-queue="invoices"] button'))
    assert "Queue invoices paused." in text_of(browser, "ul.messagelist")
    assert "paused" in browser.find_element("css selector", 'tr[data-queue="invoices"]').text
    navigate(browser, browser.find_element("css selector", 'tr[data-queue="invoices"] button'))
    assert "Queue invoices resumed." in text_of(browser, "ul.messagelist")


# Measured in the page: the crumbs' boxes, whether any shows a list marker, the trail's height.
BREADCRUMB_LAYOUT = """
const trail = document.querySelector("nav .breadcrumbs");
const crumbs = [...trail.querySelectorAll("a")];
const items = [...trail.querySelectorAll("li")];
return {
    tag: trail.tagName.toLowerCase(),
    texts: items.length ? items.map(li => li.textContent.trim())
                        : trail.textContent.split("\u203a").map(t => t.trim()).filter(Boolean),
    tops: crumbs.map(a => Math.round(a.getBoundingClientRect().top)),
    markers: items.filter(li => getComputedStyle(li).display === "list-item"
                                && getComputedStyle(li).listStyleType !== "none").length,
    height: Math.round(trail.getBoundingClientRect().height),
};
"""


def test_the_queue_admins_pages_have_the_stock_admins_breadcrumbs(browser, live_server, tmp_path):
    """The Queues and edit-and-replay pages lay their breadcrumbs out as the stock change page does.

    Measured, not looked at: every crumb on one line, no list markers, and
    the trail as tall as on the stock page, on this Django (5.2 marks
    them up as a div, 6.0 on as a list).
    """
    dead = ArchivedMessageFactory(queue="emails", outcome=Outcome.DEAD, payload={"to": "ada@example.com"})
    log_in(browser, live_server, "/admin/")
    shots = Path(os.environ.get("DBQUEUE_SCREENSHOT_DIR") or tmp_path)
    version = f"django{django.VERSION[0]}.{django.VERSION[1]}"
    pages = {
        "stock-change": f"/admin/django_dbqueue/deadletter/{dead.pk}/change/",  # the yardstick
        "overview": "/admin/django_dbqueue/queuestate/",
        "edit-and-replay": f"/admin/django_dbqueue/deadletter/{dead.pk}/edit-and-replay/",
    }
    layout = {}
    for page, path in pages.items():
        browser.get(f"{live_server.url}{path}")
        layout[page] = browser.execute_script(BREADCRUMB_LAYOUT)
        browser.save_screenshot(str(shots / f"breadcrumbs-{page}-{version}.png"))

    stock = layout["stock-change"]
    assert stock["markers"] == 0 and len(set(stock["tops"])) == 1, stock  # the yardstick itself is one line
    assert layout["overview"]["texts"] == ["Home", "Database queue", "Queues"], layout["overview"]
    assert layout["edit-and-replay"]["texts"][-3:] == ["Dead letters", str(dead), "Edit and replay"]
    for page in ("overview", "edit-and-replay"):
        found = layout[page]
        assert found["markers"] == 0, f"{page}: its crumbs show list markers (a numbered list)"
        assert len(set(found["tops"])) == 1, f"{page}: its crumbs are on several lines: {found['tops']}"
        assert abs(found["height"] - stock["height"]) <= 2, (
            f"{page}: {found['height']}px tall, stock {stock['height']}px"
        )


@pytest.mark.slow
def test_workflow_page_draws_the_graph(browser, live_server):
    """A workflow's page in a real browser: one drawn box per step; with DBQUEUE_SCREENSHOT_DIR, workflow.png there
    (docs/images/workflow.png is made so)."""
    from django_dbqueue import Step, Workflow

    workflow = Workflow("nightly-report")
    workflow.add("fetch", "reports")
    workflow.group(Step("orders", "reports"), Step("refunds", "reports"), Step("stock", "reports"), after=["fetch"])
    workflow.add("render", "reports", after=["orders", "refunds", "stock"])
    workflow.add("mail", "reports", after=["render"])
    run = workflow.enqueue()
    [fetch] = django_dbqueue.claim("reports", 1)
    fetch.ack()
    for message in django_dbqueue.claim("reports", 3):
        if message.headers["dbqueue_step"][1] == "refunds":
            message.fail("refund API: 503", retry=False)
        elif message.headers["dbqueue_step"][1] == "orders":
            message.ack()
        else:
            message.release()
    log_in(browser, live_server, f"/admin/django_dbqueue/workflowrun/{run.pk}/change/")
    boxes = browser.find_elements("css selector", "svg.dbqueue-graph g.dbqueue-step")
    assert [box.get_attribute("data-step") for box in boxes] == [
        "fetch",
        "orders",
        "refunds",
        "stock",
        "render",
        "mail",
    ]
    assert "dependency 'refunds' ended dead" in text_of(browser, "table.dbqueue-steps")
    if shots := os.environ.get("DBQUEUE_SCREENSHOT_DIR"):
        browser.save_screenshot(str(Path(shots) / "workflow.png"))
