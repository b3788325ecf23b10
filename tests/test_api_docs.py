"""The API's docs page works offline (every asset from /static/) and its error bodies are JSON
of one shape: {"field": [...]} for a 400, {"detail": "..."} for the rest, 404 and 500 included."""

import re

import pytest
from rest_framework.test import APIClient

ASSET = re.compile(r"""(?:src|href)\s*=\s*["']([^"']+)["']""")


@pytest.mark.django_db
def test_the_docs_page_loads_every_asset_from_local_static_files(client):
    response = client.get("/api/docs/")
    assert response.status_code == 200
    html = response.content.decode()
    assets = ASSET.findall(html)
    assert assets, html
    for url in assets:
        assert url.startswith("/static/"), f"{url} is not served by the portal"
        assert client.get(url).status_code == 200, url
    assert "cdn" not in html.lower() and "https://" not in html
    assert "/api/schema/" in html


@pytest.fixture
def api(make_user, token_for):
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {token_for(make_user('ann'))}")
    return client


@pytest.mark.django_db
def test_error_bodies_share_one_shape(api):
    assert api.post("/api/v1/jobs/", {}, format="json").json()["gpus"] == [
        "This field is required."
    ]
    for response, status in [
        (APIClient().get("/api/v1/jobs/"), 401),
        (api.get("/api/v1/jobs/424242/"), 404),
        (api.get("/api/v1/no-such-thing/"), 404),
        (api.delete("/api/v1/jobs/1/"), 405),
        (api.post("/api/v1/nodes/1/cordon/"), 403),
    ]:
        assert response.status_code == status
        assert response["Content-Type"].startswith("application/json")
        assert set(response.json()) == {"detail"}, response.json()


@pytest.mark.django_db
def test_an_unexpected_error_in_an_api_view_is_a_json_500(api, monkeypatch):
    def boom(user):
        raise RuntimeError("secret internals")

    monkeypatch.setattr("jobs.api.visible_jobs", boom)
    response = api.get("/api/v1/jobs/")
    assert response.status_code == 500
    assert response.json() == {"detail": "Internal server error."}


@pytest.mark.django_db
def test_huge_limits_and_offsets_are_bounded_not_a_database_error(api):
    # Found by the schema fuzz: SQLite and PostgreSQL overflow on a limit past 64 bits.
    response = api.get(f"/api/v1/jobs/?limit={10**21}&offset={10**21}")
    assert response.status_code == 200
    assert response.json()["results"] == []
