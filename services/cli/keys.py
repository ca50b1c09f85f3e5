"""``ocrstream keys create|revoke|list``: the HTTP door's API keys, kept in MariaDB.

Only a key's SHA-256 is stored (``services.common.keys.api_keys``); a key and its webhook secret
are printed once, at ``create`` (``docs/http-api.md``).
"""

from __future__ import annotations

import asyncio
import time
from typing import Optional

import typer
from rich.console import Console

from services.cli.options import bounded
from services.common.cache.keys import CacheKeySettings
from services.common.settings import load_settings

keys_app = typer.Typer(no_args_is_help=True, help="Manage the API keys of the HTTP door.")
console = Console(soft_wrap=True)
err = Console(stderr=True)


def _key_store():
    from services.common.db import Database
    from services.common.keys.api_keys import KeyStore

    return KeyStore(Database(load_settings(CacheKeySettings).mysql, pool_size=1))


def _ms_time(ms: int | None) -> str:
    return "" if ms is None else time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(ms / 1000)) + "Z"


@keys_app.command("create")
def keys_create(
    name: str = typer.Option(..., "--name", help="The key's label: who or what uses it."),
    rate: Optional[float] = bounded(None, "--rate", lo=0, hi=1_000_000, unit="requests/s", help=(
        "The key's request rate (0: unlimited; by default the door's OCRSTREAM_RATE_LIMIT_PER_S)")),
    burst: Optional[int] = bounded(None, "--burst", kind=int, lo=1, hi=1_000_000, unit="requests", help=(
        "The key's token bucket size (by default the door's OCRSTREAM_RATE_LIMIT_BURST)")),
    quota_per_day: Optional[int] = bounded(None, "--quota-per-day", kind=int, lo=0, hi=1_000_000_000,
                                           unit="submissions", help=(
        "The key's submissions per UTC day (0: no quota; by default the door's OCRSTREAM_QUOTA_PER_DAY)")),
) -> None:
    """Create an API key for the HTTP door, and print it and its webhook secret once.

    Only the key's SHA-256 is stored: keep the key when it is printed, it is not shown again.
    """
    try:
        new = asyncio.run(_key_store().create(name, rate_per_s=rate, burst=burst, quota_per_day=quota_per_day))
    except ValueError as exc:
        err.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2)
    console.print(f"key_id:         {new.key.key_id}", highlight=False)
    console.print(f"api_key:        {new.token}", highlight=False)
    console.print(f"webhook_secret: {new.webhook_secret}", highlight=False)
    err.print("Store both now: the key is not shown again (only its SHA-256 is kept).")


@keys_app.command("revoke")
def keys_revoke(key_id: str = typer.Argument(..., help="The key's id (the part after ocs_).")) -> None:
    """Revoke an API key: running doors refuse it within OCRSTREAM_AUTH_CACHE_S seconds.

    Exit 1 when no key has this id.
    """
    key = asyncio.run(_key_store().revoke(key_id))
    if key is None:
        err.print(f"[red]error:[/red] no API key {key_id!r}")
        raise typer.Exit(1)
    console.print(f"revoked {key.key_id} ({key.name}) at {_ms_time(key.revoked_at_ms)}", highlight=False)


@keys_app.command("list")
def keys_list(
    all_: bool = typer.Option(True, "--all/--active", help="List revoked keys too (--active: only the others)."),
) -> None:
    """List the API keys: id, name, limits, and when each was created and revoked.

    Neither a key nor a webhook secret is ever shown.
    """
    from rich.table import Table

    keys = asyncio.run(_key_store().list(include_revoked=all_))
    dflt = "default"
    table = Table("key_id", "name", "rate/s", "burst", "quota/day", "created (UTC)", "revoked (UTC)")
    for k in keys:
        table.add_row(k.key_id, k.name, dflt if k.rate_per_s is None else f"{k.rate_per_s:g}",
                      dflt if k.burst is None else str(k.burst),
                      dflt if k.quota_per_day is None else str(k.quota_per_day),
                      _ms_time(k.created_at_ms), _ms_time(k.revoked_at_ms))
    console.print(table)
