"""The turn pipeline's one door to costs: charge each upstream request to the person's ledger,
price what the gateway did not, ask the gateway's own bill afterwards (in the background, with
retries, a few at a time), correct the figure in the ledger and the conversation, and refuse new
turns past a person's monthly budget.

Reconciliation (`COST_RECONCILE`) asks OpenRouter's `GET {base}/v1/generation?id=` by the
generation id a stream names (`gen-...`), or a LiteLLM proxy's `GET {base}/spend/logs?request_id=`
by its `x-litellm-call-id`; `auto` picks by which of the two the answer carried. Charges waiting
for it are kept in the store, so a server that restarts, or any other server, finishes the job.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import math
import time
from typing import TYPE_CHECKING

import httpx2

from chatserver.config import Settings
from chatserver.conversations.usage import replace_cost
from chatserver.costs.charges import TO_RECONCILE, entry, new_charge, set_cost
from chatserver.costs.ledger import FileLedger, Ledger, month_of
from chatserver.costs.prices import Price, price_from, published_prices
from chatserver.store.files import NotFound, Store
from chatserver.turns import context
from chatserver.upstream.failures import UpstreamError

if TYPE_CHECKING:
    from chatserver.turns.pipeline import Turn
    from chatserver.upstream.client import Gateway

log = logging.getLogger("chat.costs")

# Lookups under way at once, per server: the gateway's accounting API is not for bulk traffic.
RECONCILE_CONCURRENCY = 4
# Seconds before each lookup: the gateway writes its record a moment after the stream ends.
RECONCILE_DELAYS = (0.2, 0.5, 1, 2, 4, 8, 16, 30, 60)
PUBLISHED_PRICES_TTL = 3600.0
WARN_SHARE = 0.8


class BudgetSpent(UpstreamError):
    """A new turn past the person's monthly budget (the failure kind `budget`)."""


def has_images(messages: list[dict]) -> bool:
    """Whether a prompt carries an image (a vision request, counted apart)."""
    return any(isinstance(part, dict) and part.get("type") in ("image_url", "image", "input_image")
               for m in messages if isinstance(m.get("content"), list) for part in m["content"])


def next_month(now: dt.datetime) -> dt.datetime:
    return dt.datetime(now.year + now.month // 12, now.month % 12 + 1, 1, tzinfo=dt.UTC)


class Costs:
    def __init__(self, settings: Settings, gateway: Gateway, ledger: Ledger | None = None) -> None:
        self.settings = settings
        self.gateway = gateway
        self.ledger: Ledger = ledger if ledger is not None else FileLedger(settings.data_dir)
        # Set by the app: reconciliation corrects the conversation's figures through it.
        self.store: Store | None = None
        self.delays: tuple[float, ...] = RECONCILE_DELAYS
        self._published: dict[str, Price] = {}
        self._published_at = -math.inf
        self._refreshing: asyncio.Task | None = None
        self._slots: asyncio.Semaphore | None = None
        self._tasks: set[asyncio.Task] = set()
        self._queued: set[tuple[str, str]] = set()

    # --- Prices ------------------------------------------------------------------------------

    async def admin_prices(self) -> dict[str, Price]:
        stored = await self.ledger.read_setting("prices")
        return {model: price for model, value in stored.items() if (price := price_from(value)) is not None}

    async def set_price(self, model: str, price: Price | None) -> None:
        stored = await self.ledger.read_setting("prices")
        if price is None:
            stored.pop(model, None)
        else:
            stored[model] = price.as_json()
        await self.ledger.write_setting("prices", stored)

    async def refresh_prices(self) -> None:
        """Read the gateway's model list's prices (OpenRouter's); none when it publishes none."""
        try:
            response = await self.gateway.client.get(self.gateway.url("/v1/models"), headers=self._auth(), timeout=10)
            self._published = published_prices(response.json()) if response.status_code == 200 else {}
        except (httpx2.HTTPError, ValueError, RuntimeError):
            # Unreachable now (or the client closed under a shutdown): the prices read before stay,
            # and the next hour tries again.
            pass
        self._published_at = time.monotonic()

    async def published_prices(self, *, wait: bool = False) -> dict[str, Price]:
        """The gateway's prices as last read, read again in the background at most hourly. A turn
        never waits for the gateway's model list (`wait`: a route that shows prices does)."""
        if time.monotonic() - self._published_at > PUBLISHED_PRICES_TTL \
                and (self._refreshing is None or self._refreshing.done()):
            self._refreshing = asyncio.create_task(self.refresh_prices())
        if wait and self._refreshing is not None and not self._refreshing.done():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._refreshing), 10)
        return self._published

    async def prices(self, *, wait: bool = False) -> dict[str, tuple[Price, str]]:
        """Each priced model's price and where it came from (`admin` wins over `gateway`)."""
        out = {model: (price, "gateway") for model, price in (await self.published_prices(wait=wait)).items()}
        out.update({model: (price, "admin") for model, price in (await self.admin_prices()).items()})
        return out

    async def price_of(self, model: str) -> Price | None:
        found = (await self.prices()).get(model)
        return found[0] if found else None

    # --- Charging ----------------------------------------------------------------------------

    async def reply(self, turn: Turn, usage: dict, sent_floor: int) -> list[dict]:
        """Charge a reply's requests (tool rounds apart) and set its usage's cost from them (in
        place); the charges to reconcile once the reply is stored are returned."""
        # Stopped before the answer's head arrived: billed all the same, and no id to ask about.
        calls = turn.reply.calls or ([{}] if turn.requested else [])
        price = await self.price_of(turn.model)
        charges = []
        for n, call in enumerate(calls):
            last = n == len(calls) - 1
            if "usage" in call:
                measured = context.normalize_usage(call["usage"], sent_floor=sent_floor)
            elif len(calls) == 1 or (last and not turn.reply.usages):
                measured = usage  # the reply's own estimate is this request's
            else:
                measured = context.normalize_usage(None, sent_floor=sent_floor)
            kind = "tool" if not last else ("vision" if turn.vision else "reply")
            charge = new_charge(owner=turn.store.owner, conv_id=turn.conv_id, message_id=turn.assistant_id,
                                model=turn.model, kind=kind, usage=measured, call=call, price=price,
                                counts_turn=last)
            call["charge"] = charge["id"]
            charges.append(charge)
        # A tool's own model call (analyze_image asks VISION_MODEL) is this reply's request too.
        for step in turn.reply.activity:
            asked = step.get("usage") if step.get("kind") == "tool" else None
            if isinstance(asked, dict) and asked.get("model"):
                charges.append(new_charge(
                    owner=turn.store.owner, conv_id=turn.conv_id, message_id=turn.assistant_id, model=asked["model"],
                    kind="vision", usage=asked, call=None, price=await self.price_of(asked["model"])))
        await self._record(turn.store.owner, charges)
        set_cost(usage, [entry(c) for c in charges])
        return charges

    async def leftovers(self, turn: Turn) -> None:
        """Requests of a turn that stored no reply (it failed before any output, or nothing came)
        were billed all the same: they are charged to no message."""
        calls = [c for c in turn.reply.calls if "charge" not in c]
        if not calls:
            return
        price = await self.price_of(turn.model)
        charges = []
        for call in calls:
            usage = context.normalize_usage(call.get("usage"), sent_floor=0)
            charge = new_charge(owner=turn.store.owner, conv_id=turn.conv_id, message_id=None, model=turn.model,
                                kind="reply", usage=usage, call=call, price=price)
            call["charge"] = charge["id"]
            charges.append(charge)
        await self._record(turn.store.owner, charges)
        self.reconcile_soon(turn.store.owner, charges)

    async def call(self, owner: str, conv_id: str, kind: str, model: str, usage: dict, call: dict,
                   message_id: str | None = None) -> list[dict]:
        """Charge one summarizer call (a title, a summary) and set its usage's cost (in place)."""
        charge = new_charge(owner=owner, conv_id=conv_id, message_id=message_id, model=model, kind=kind,
                            usage=usage, call=call, price=await self.price_of(model))
        await self._record(owner, [charge])
        set_cost(usage, [entry(charge)])
        return [charge]

    async def _record(self, owner: str, charges: list[dict]) -> None:
        """Into the ledger; a ledger that cannot be written must not cost the person their reply."""
        for charge in charges:
            try:
                await self.ledger.put(owner, charge)
                if self._reconcilable(charge):
                    await self.ledger.wait_for_gateway(owner, charge["id"])
            except Exception:
                log.exception("charge %s (%s, $%s) could not be written to the ledger", charge["id"],
                              charge["model"], charge["cost"])

    # --- Reconciliation ----------------------------------------------------------------------

    def _way(self, charge: dict) -> str | None:
        """How this charge's bill can be asked for: `openrouter`, `litellm`, or not at all."""
        mode = self.settings.cost_reconcile
        if mode == "off":
            return None
        generation, request = charge.get("generation"), charge.get("request")
        if mode == "litellm" or (mode == "auto" and request):
            return "litellm" if request else None
        if mode == "openrouter":
            return "openrouter" if generation else None
        return "openrouter" if isinstance(generation, str) and generation.startswith("gen-") else None

    def _reconcilable(self, charge: dict) -> bool:
        return charge["source"] in TO_RECONCILE and self._way(charge) is not None

    def reconcile_soon(self, owner: str, charges: list[dict]) -> None:
        """Ask the gateway's bill for these charges, in the background (after they are stored)."""
        for charge in charges:
            if self._reconcilable(charge) and (owner, charge["id"]) not in self._queued:
                self._queued.add((owner, charge["id"]))
                task = asyncio.create_task(self._reconcile(owner, charge["id"]))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    async def resume(self) -> None:
        """At start: take up the charges still waiting for the gateway's bill (this server's or another's)."""
        for owner, charge_id in await self.ledger.waiting():
            charge = await self.ledger.get(owner, charge_id)
            if charge is None or not self._reconcilable(charge):
                await self.ledger.settled(owner, charge_id)
            else:
                self.reconcile_soon(owner, [charge])

    async def idle(self) -> None:
        """Wait for the reconciliations under way (tests, shutdown)."""
        while self._tasks:
            await asyncio.wait(list(self._tasks))

    async def close(self) -> None:
        running = [*self._tasks, *([self._refreshing] if self._refreshing is not None else [])]
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)  # charges are left waiting in the store for the next start
        await self.ledger.close()

    async def _reconcile(self, owner: str, charge_id: str) -> None:
        if self._slots is None:
            self._slots = asyncio.Semaphore(RECONCILE_CONCURRENCY)
        try:
            for delay in self.delays:
                await asyncio.sleep(delay)
                charge = await self.ledger.get(owner, charge_id)
                if charge is None or not self._reconcilable(charge):
                    break
                async with self._slots:
                    cost = await self._ask(charge)
                if cost is not None:
                    fixed = {**charge, "cost": cost, "source": "reconciled"}
                    await self.ledger.put(owner, fixed)
                    await self._correct_conversation(owner, charge, fixed)
                    break
            else:
                log.warning("the gateway kept no bill for %s after %d tries; its cost stays as it was",
                            charge_id, len(self.delays))
                return  # left waiting: a later start tries again
            await self.ledger.settled(owner, charge_id)
        except Exception:
            log.exception("reconciling %s failed", charge_id)
        finally:
            self._queued.discard((owner, charge_id))

    def _auth(self) -> dict:
        key = self.gateway.api_key
        return {"Authorization": f"Bearer {key}"} if key else {}

    async def _ask(self, charge: dict) -> float | None:
        """The gateway's own figure for this charge, or None when it has none (yet)."""
        way = self._way(charge)
        try:
            if way == "openrouter":
                response = await self.gateway.client.get(self.gateway.url("/v1/generation"),
                                                         params={"id": charge["generation"]}, headers=self._auth())
                data = response.json().get("data") if response.status_code == 200 else None
                cost = data.get("total_cost") if isinstance(data, dict) else None
            else:
                response = await self.gateway.client.get(self.gateway.url("/spend/logs"),
                                                         params={"request_id": charge["request"]},
                                                         headers=self._auth())
                rows = response.json() if response.status_code == 200 else None
                row = rows[0] if isinstance(rows, list) and rows and isinstance(rows[0], dict) else {}
                cost = row.get("spend")
        except (httpx2.HTTPError, ValueError, AttributeError) as exc:
            log.info("asking the gateway's bill for %s failed: %s", charge["id"], type(exc).__name__)
            return None
        if isinstance(cost, bool) or not isinstance(cost, int | float) or not math.isfinite(cost) or cost < 0:
            return None
        return round(float(cost), 10)

    async def _correct_conversation(self, owner: str, old: dict, new: dict) -> None:
        """The corrected figure where the conversation shows it: its reply's or notice's usage, and its totals."""
        if self.store is None:
            return
        if new["kind"] == "title":
            def change(c: dict) -> None:
                replace_cost(c["totals"], {"cost": old["cost"], "charges": [entry(old)]},
                             {"cost": new["cost"], "charges": [entry(new)]}, apart="title_cost")
        elif new["message"] is not None:
            def change(c: dict) -> None:
                lists = (c.get("messages") or [], c.get("archive") or [], c.get("off_path") or [])
                message = next((m for items in lists for m in items if m.get("id") == new["message"]), None)
                usage = message.get("usage") if message else None
                if not usage or not any(e["id"] == new["id"] for e in usage.get("charges") or []):
                    return
                before = {"cost": usage.get("cost"), "charges": usage["charges"]}
                set_cost(usage, [entry(new) if e["id"] == new["id"] else e for e in usage["charges"]])
                if message is not None and message.get("status") != "streaming":
                    replace_cost(c["totals"], before, usage,
                                 apart="compression_cost" if new["kind"] == "summary" else None)
        else:
            return
        with contextlib.suppress(NotFound):
            await self.store.for_owner(owner).update(new["conversation"], change)

    # --- Budgets -----------------------------------------------------------------------------

    async def budget_of(self, owner: str) -> float | None:
        """The person's monthly budget in USD: theirs if an admin set one, else DEFAULT_MONTHLY_BUDGET."""
        budgets = await self.ledger.read_setting("budgets")
        if owner in budgets:
            value = budgets[owner]
            return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None
        return self.settings.default_monthly_budget

    async def set_budget(self, owner: str, budget: float | None, *, default: bool = False) -> None:
        """An admin's word: a budget, no budget (`None`), or back to the default (`default`)."""
        budgets = await self.ledger.read_setting("budgets")
        if default:
            budgets.pop(owner, None)
        else:
            budgets[owner] = budget
        await self.ledger.write_setting("budgets", budgets)

    async def standing(self, owner: str, now: dt.datetime | None = None) -> dict:
        """This month's spend against the budget, for the page and the refusal."""
        now = now or dt.datetime.now(dt.UTC)
        month = month_of(now)
        spent = await self.ledger.month_spent(owner, month)
        budget = await self.budget_of(owner)
        share = (spent / budget if budget > 0 else math.inf) if budget is not None else None
        return {"month": month, "spent": round(spent, 6), "budget": budget,
                "share": None if share is None else min(share, 1e9),
                "warning": share is not None and share >= WARN_SHARE, "exceeded": share is not None and share >= 1,
                "resets_at": next_month(now).isoformat()}

    async def admit(self, owner: str) -> None:
        """BudgetSpent when the person's month is spent; a turn under way is never stopped by it."""
        standing = await self.standing(owner)
        if standing["exceeded"]:
            raise BudgetSpent("budget", f"Your monthly budget is spent: ${standing['spent']:.2f} of "
                                        f"${standing['budget']:.2f} this month. It resets on "
                                        f"{standing['resets_at'][:10]} (UTC); an administrator can raise it.")
