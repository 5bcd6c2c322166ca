"""Usage, budgets and prices (issue 28): `GET /api/usage` reports the person's ledger grouped one
way (admins may ask about anyone, and by person); budgets and prices are set by admins.

Whose ledger a request reads is decided here from the signed-in user only: a person sees their
own charges; `person=` (another's) and `group=person` are for admins.
"""

from __future__ import annotations

import datetime as dt
from typing import Literal

import orjson
from fastapi import APIRouter, HTTPException, Query, Request
from fastapi.responses import Response

from chatserver.api.deps import AdminDep, StateDep, UserDep
from chatserver.api.schemas import BudgetPut, PricePut
from chatserver.costs.ledger import months_between
from chatserver.costs.prices import Price
from chatserver.costs.report import as_csv, in_span, report
from chatserver.store.files import OWNER_PATTERN

router = APIRouter(prefix="/api", tags=["usage"])

MAX_SPAN_DAYS = 3 * 366


def _day(value: str | None, default: dt.date, name: str) -> dt.date:
    if value is None or value == "":
        return default
    try:
        return dt.date.fromisoformat(value)
    except ValueError:
        raise HTTPException(422, f"{name}: {value[:40]!r} is not a date (YYYY-MM-DD)") from None


async def _names(request: Request) -> dict[str, str]:
    """Owner id -> user name, where accounts know one (the person column reads better by name)."""
    accounts = getattr(request.app.state, "accounts", None)
    if accounts is None:
        return {}
    return {u["owner"]: u["name"] for u in await accounts.store.users() if "owner" in u and "name" in u}


@router.get("/usage")
async def usage(request: Request, state: StateDep, user: UserDep,
                start: str | None = Query(None, alias="from"), end: str | None = Query(None, alias="to"),
                group: Literal["day", "model", "conversation", "kind", "person"] = "day",
                person: str | None = Query(None, max_length=64),
                format: Literal["json", "csv"] = "json") -> Response:
    """The ledger from `from` to `to` (UTC days, inclusive; the last 30 days by default)."""
    today = dt.datetime.now(dt.UTC).date()
    last = _day(end, today, "to")
    first = _day(start, last - dt.timedelta(days=29), "from")
    if first > last:
        raise HTTPException(422, "from: must not be after to")
    if (last - first).days > MAX_SPAN_DAYS:
        raise HTTPException(422, f"the span may be at most {MAX_SPAN_DAYS} days")
    if (group == "person" or (person is not None and person != user.owner)) and not user.admin:
        raise HTTPException(403, "only an administrator may see other people's usage")
    if person is not None:
        _person(person)
    ledger = state.turns.costs.ledger
    if group == "person":
        owners = await ledger.owners() if person is None else [person]
    else:
        owners = [person or user.owner]
    months = months_between(dt.datetime(first.year, first.month, 1), dt.datetime(last.year, last.month, 1))
    charges = [c for owner in owners for month in months for c in await ledger.month(owner, month)]
    answer = report(in_span(charges, first, last), group)
    if group == "conversation":
        titles = {c["id"]: c["title"] for owner in owners for c in await state.store.for_owner(owner).list()}
        for row in answer["rows"]:
            row["label"] = titles.get(row["key"], "(deleted)" if row["key"] else "(no conversation)")
    elif group == "person":
        names = await _names(request)
        for row in answer["rows"]:
            row["label"] = names.get(row["key"], row["key"])
    answer.update({"from": first.isoformat(), "to": last.isoformat(), "group": group,
                   "person": None if group == "person" else owners[0]})
    if format == "csv":
        return Response(as_csv(answer, group), media_type="text/csv; charset=utf-8", headers={
            "Content-Disposition": f'attachment; filename="usage-{group}-{first}-{last}.csv"'})
    return Response(orjson.dumps(answer), media_type="application/json")


@router.get("/usage/budget")
async def my_budget(state: StateDep, user: UserDep) -> dict:
    """This month's spend against the person's budget (`warning` from 80%, `exceeded` at 100%)."""
    return await state.turns.costs.standing(user.owner)


@router.get("/usage/people")
async def people(request: Request, state: StateDep, admin: AdminDep) -> list[dict]:
    """Admins: everyone who has spent or has an account, with this month's standing."""
    costs = state.turns.costs
    names = await _names(request)
    owners = sorted(set(await costs.ledger.owners()) | set(names) | {admin.owner})
    return [{"person": owner, "name": names.get(owner, owner), **await costs.standing(owner)} for owner in owners]


@router.put("/usage/budgets/{person}")
async def set_budget(person: str, body: BudgetPut, state: StateDep, admin: AdminDep) -> dict:
    await state.turns.costs.set_budget(_person(person), body.budget)
    return await state.turns.costs.standing(person)


@router.delete("/usage/budgets/{person}")
async def default_budget(person: str, state: StateDep, admin: AdminDep) -> dict:
    """Back to DEFAULT_MONTHLY_BUDGET."""
    await state.turns.costs.set_budget(_person(person), None, default=True)
    return await state.turns.costs.standing(person)


def _person(person: str) -> str:
    if not OWNER_PATTERN.fullmatch(person):
        raise HTTPException(422, "person: not a person's id")
    return person


@router.get("/prices")
async def prices(state: StateDep) -> dict:
    """Each priced model: USD per million tokens and whether an admin or the gateway set it."""
    return {model: {**price.as_json(), "source": source}
            for model, (price, source) in (await state.turns.costs.prices(wait=True)).items()}


@router.put("/prices/{model_id:path}")
async def set_price(model_id: str, body: PricePut, state: StateDep, admin: AdminDep) -> dict:
    if not model_id or len(model_id) > 200 or any(ch.isspace() or ord(ch) < 32 for ch in model_id):
        raise HTTPException(422, "model: 1 to 200 characters, no whitespace or control characters")
    price = Price(body.input, body.output, body.cache_read, body.cache_write)
    await state.turns.costs.set_price(model_id, price)
    return {"id": model_id, **price.as_json(), "source": "admin"}


@router.delete("/prices/{model_id:path}", status_code=204)
async def clear_price(model_id: str, state: StateDep, admin: AdminDep) -> Response:
    await state.turns.costs.set_price(model_id, None)
    return Response(status_code=204)
