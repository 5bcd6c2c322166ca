"""The usage page and the budget warning, in the browser (issue 28)."""

from __future__ import annotations

import csv
import io

import pytest
from playwright.sync_api import expect

from gateway_sim.simulator import GatewaySimulator, Script, Text, Usage
from pagekit import conversation_id, eventually, exchange, open_page

CHEAP, DEAR = "openai/gpt-5-mini", "anthropic/claude-sonnet-4.5"


@pytest.fixture(scope="module")
def gateway():
    """A gateway that bills, reports what it charged and publishes its prices."""
    prices = {CHEAP: (1.0, 4.0, 0.1, 1.25), DEAR: (3.0, 15.0, 0.3, 3.75)}
    with GatewaySimulator(keep_requests=1000, billing="openrouter", prices=prices) as sim:
        yield sim


def canvas_has_ink(page, test_id: str) -> bool:
    return page.evaluate("""id => {
        const canvas = document.querySelector(`[data-test=${id}] canvas`);
        const data = canvas.getContext('2d').getImageData(0, 0, canvas.width, canvas.height).data;
        let inked = 0;
        for (let i = 3; i < data.length; i += 4) if (data[i] > 0) inked++;
        return inked > 500;
    }""", test_id)


def test_the_usage_page_draws_its_plots_from_the_usage_api_and_its_csv_matches_the_table(page, server, sim):
    exchange(page, "A first question for the cheap model")
    page.get_by_test_id("model-picker").select_option(DEAR)
    exchange(page, "A second question for the dear one")

    asked: list[str] = []
    page.on("request", lambda r: asked.append(r.url) if "/api/usage?" in r.url else None)
    page.get_by_test_id("usage-open").click()
    expect(page.locator("body")).to_have_attribute("data-ready", "true")
    assert any("group=day" in url for url in asked) and any("group=kind" in url for url in asked)

    spend = page.get_by_test_id("chart-spend")
    legend = spend.locator(".u-legend .u-label")
    expect(legend.filter(has_text=CHEAP)).to_have_count(1)
    expect(legend.filter(has_text=DEAR)).to_have_count(1)
    for chart in ("chart-spend", "chart-cached", "chart-kinds"):
        assert canvas_has_ink(page, chart), chart
    expect(page.get_by_test_id("chart-kinds").locator(".u-legend")).to_contain_text("Output tokens")

    rows = page.get_by_test_id("usage-row")
    expect(rows).not_to_have_count(0)
    table = [[cell.replace(",", "") for cell in row.locator("td").all_inner_texts()] for row in rows.all()]
    href = page.get_by_test_id("usage-csv").get_attribute("href")
    response = page.request.get(server.base_url + href)
    assert response.ok and response.headers["content-type"].startswith("text/csv")
    lines = list(csv.reader(io.StringIO(response.text())))
    assert lines[0][:6] == ["conversation", "label", "input_tokens", "cached_tokens", "output_tokens", "cost_usd"]
    from_csv = [[line[1], line[2], line[3], line[4], line[5], line[11]] for line in lines[1:]]
    assert from_csv == table
    spent = sum(float(line[5]) for line in lines[1:])
    assert spent == pytest.approx(sim.billed_total(), abs=1e-6)
    assert page.js_errors == [], page.js_errors


def test_the_page_warns_at_80_percent_of_the_monthly_budget(page, server, sim):
    spent = server.api("GET", "/api/usage/budget").json()["spent"]
    cost = 0.85
    # A budget the next turn takes to 85%: under 80% before it.
    budget = round((spent + cost) / 0.85, 6)
    assert server.api("PUT", "/api/usage/budgets/local", json={"budget": budget}).status_code == 200
    page.reload()
    expect(page.locator("body")).to_have_attribute("data-ready", "true")
    warning = page.get_by_test_id("budget-warning")
    expect(warning).to_be_hidden()

    # Chat completions, whose usage carries what OpenRouter charged (its Messages usage does not).
    server.api("PATCH", f"/api/conversations/{conversation_id(page)}", json={"settings": {"web_search": False,
                                                                                      "web_fetch": False}})
    sim.enqueue(Script([Text("A dear answer.")], usage=Usage(prompt=100, completion=10, cost=cost, dialect="openrouter")))
    exchange(page, "Something that costs a lot")
    expect(warning).to_be_visible()
    expect(warning).to_contain_text("85% of the monthly budget")
    expect(warning).to_contain_text("at 100% new messages are refused")

    usage = open_page(page.context.browser, server.base_url + "/usage")
    expect(usage.locator("body")).to_have_attribute("data-ready", "true")
    expect(usage.get_by_test_id("budget-warning")).to_be_visible()
    expect(usage.get_by_test_id("usage-budget")).to_contain_text("85%")
    eventually(lambda: usage.get_by_test_id("usage-people").is_visible())  # the one person is the admin
    assert usage.js_errors == [], usage.js_errors
    usage.context.close()


def test_an_admin_prices_a_model_in_settings(page, server):
    page.get_by_test_id("settings-open").click()
    price = page.get_by_test_id("model-price").nth(0)
    model = server.models()["tiers"][0]["models"][0]["id"]
    price.locator("summary").click()
    price.get_by_test_id("price-input").fill("0.5")
    price.get_by_test_id("price-output").fill("2")
    price.get_by_role("button", name="Save price").click()
    summary = page.get_by_test_id("model-price").nth(0).locator("summary")
    expect(summary).to_contain_text("$0.5 in / $2 out per M tokens (set here)")
    assert server.api("GET", "/api/prices").json()[model] == {
        "input": 0.5, "output": 2.0, "cache_read": None, "cache_write": None, "source": "admin"}
    page.get_by_test_id("model-price").nth(0).locator("summary").click()
    page.get_by_test_id("model-price").nth(0).get_by_role("button", name="Clear").click()
    eventually(lambda: model not in server.api("GET", "/api/prices").json()
               or server.api("GET", "/api/prices").json()[model]["source"] == "gateway")
