"""A request's id is minted and checked in one place, `lifecycle.core.requestid`."""

from __future__ import annotations

import pytest

from lifecycle.core.errors import ConfigError
from lifecycle.core.format.runid import is_run_id
from lifecycle.core.requestid import REQUEST_ID_RULE, request_id_of


def test_a_request_without_a_name_gets_a_new_id_of_the_one_form() -> None:
    """Each id minted for an unnamed request is new, 12 hex digits, and of a run id's form."""
    minted = {request_id_of(None) for _ in range(100)}
    assert len(minted) == 100
    assert all(len(i) == 12 and is_run_id(i) and int(i, 16) >= 0 for i in minted)


@pytest.mark.parametrize("named", ["req-1", "A.b_c-9", "x" * 64])
def test_a_client_id_of_the_one_form_is_kept(named: str) -> None:
    """A client's X-Request-ID of the one form names its request as it is."""
    assert request_id_of(named) == named


@pytest.mark.parametrize("named", ["", "../etc", "-lead", "a b", "x" * 65, "é"])
def test_a_client_id_of_another_form_is_refused_with_the_rule(named: str) -> None:
    """Any other X-Request-ID is a ConfigError stating the rule."""
    with pytest.raises(ConfigError) as refused:
        request_id_of(named)
    assert str(refused.value) == REQUEST_ID_RULE
