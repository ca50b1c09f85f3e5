"""The HTTP door's upload budget: bytes held in memory at once, across requests."""

import pytest

from services.ingest.api.errors import ApiError
from services.ingest.api.uploads import UploadBudget


def test_budget_refuses_past_its_limit_and_releases_per_request():
    budget = UploadBudget(100)
    a, b = budget.reservation(), budget.reservation()
    a.take(60)
    b.take(40)
    assert budget.used == 100
    with pytest.raises(ApiError) as err:
        b.take(1)
    assert err.value.status == 503 and err.value.code == "overloaded" and err.value.headers == {"Retry-After": "1"}
    a.release()
    a.release()  # idempotent
    assert budget.used == 40
    b.take(60)
    b.release()
    assert budget.used == 0


def test_zero_means_unbounded():
    r = UploadBudget(0).reservation()
    r.take(10**12)
    assert r.held == 10**12
