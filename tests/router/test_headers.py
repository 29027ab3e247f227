"""Which client headers the router sends on to workers (``Headers.of``): X-Request-ID, the
allow-listed names and ``x-request-id-*`` (as smg does), never a value with CR or LF."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from pdctl.router.shaping import FORWARDED, Headers

NAMES = st.sampled_from(
    [*sorted(FORWARDED), "x-request-id-tenant", "x-request-id-", "x-request-idx", "host", "cookie", "authorization"]
)
VALUES = st.text(alphabet=st.sampled_from("ab-\r\n\xe9 "), max_size=6)


@given(st.dictionaries(st.one_of(NAMES, st.text(alphabet="abx-", max_size=15)), VALUES, max_size=8))
def test_forwarded_headers_are_the_allow_listed_ones_without_cr_or_lf(client: dict[str, str]) -> None:
    headers = Headers.of("rid", client)
    wanted = {
        name: value
        for name, value in client.items()
        if (name in FORWARDED or name.startswith("x-request-id-")) and "\r" not in value and "\n" not in value
    }
    assert headers.upstream == {**wanted, "X-Request-ID": "rid"}
    assert dict(headers) == {"X-Request-ID": "rid"}


def test_a_request_without_forwarded_headers_sends_only_its_id() -> None:
    headers = Headers.of("r1", {"host": "x", "content-type": "application/json", "x-request-idx": "no"})
    assert headers.upstream == {"X-Request-ID": "r1"} and headers == {"X-Request-ID": "r1"}
    tenant = Headers.of("r2", {"host": "x", "x-request-id-tenant": "t7", "traceparent": "00-a\r\nX: 1"})
    assert tenant.upstream == {"x-request-id-tenant": "t7", "X-Request-ID": "r2"}
