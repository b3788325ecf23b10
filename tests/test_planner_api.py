"""Memory planner (trainer/planner.py), where it is read: the `lockstep plan` CLI, POST
/api/v1/plan/ (the same library, plus the step-time model's figures), and the submit page's check,
in Django and in headless Chromium."""

import json

import pytest
from django.contrib.staticfiles import finders
from rest_framework.test import APIClient

from lockstep_cli.cli import main as cli_main
from tests.planner_helpers import LLAMA_70B
from trainer.layout import NEAR_TIE, choose, runnable
from trainer.planner import ClusterShape, ModelShape, plan
from trainer.step_time import H100_NODE, step_time

# --- CLI ----------------------------------------------------------------------------------

EXAMPLE_ARGS = [
    "plan",
    "--params",
    "70e9",
    "--layers",
    "80",
    "--hidden",
    "8192",
    "--heads",
    "64",
    "--vocab",
    "128256",
    "--seq",
    "4096",
    "--micro-batch",
    "1",
    "--gpus",
    "512",
    "--gpus-per-node",
    "8",
    "--gpu-mem-gb",
    "80",
]


def test_cli_json_prints_layouts_and_the_recommendation(capsys):
    assert cli_main([*EXAMPLE_ARGS, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {"layouts", "recommended"} <= set(out)
    assert out["model"]["params"] == 70 * 10**9
    for layout in out["layouts"]:
        assert {"dp", "tp", "pp", "zero", "per_gpu_bytes", "comm_bytes_per_step", "fits"} <= set(
            layout
        )
        assert layout["zero"] in (0, 1, 2, 3)
        parts = layout["per_gpu_bytes"]
        assert {"weights", "grads", "optimizer", "activations", "total"} <= set(parts)
        assert parts["total"] == pytest.approx(
            sum(parts[k] for k in ("weights", "grads", "optimizer", "activations", "overhead")),
            abs=5,
        )
    assert out["recommended"] in out["layouts"]


def test_cli_prints_a_table_with_the_recommendation(capsys):
    assert cli_main(EXAMPLE_ARGS) == 0
    out = capsys.readouterr().out
    assert "recommended: dp=64 tp=8 pp=1 ZeRO-1" in out
    assert "<- recommended" in out
    assert "fastest predicted on H100/H200" in out and "(what --layout auto takes)" in out


@pytest.mark.parametrize(
    "change, message",
    [
        (["--hidden", "8190"], "--hidden: 8190 is not divisible by heads"),
        (["--params", "1.5"], "--params: must be a whole number"),
        (["--gpus", "12"], "--gpus: 12 GPUs is not a whole number of 8-GPU nodes"),
        (["--micro-batch", "0"], "--micro-batch: must be a positive integer"),
    ],
)
def test_cli_bad_input_is_a_clear_message_and_exit_2(capsys, change, message):
    assert cli_main([*EXAMPLE_ARGS, *change]) == 2
    captured = capsys.readouterr()
    assert message in captured.err
    assert captured.out == ""


def test_cli_unparseable_input_exits_2(capsys):
    with pytest.raises(SystemExit) as raised:
        cli_main([*EXAMPLE_ARGS, "--dtype", "fp8"])
    assert raised.value.code == 2
    assert "invalid choice: 'fp8'" in capsys.readouterr().err


# --- API and the submit page ---------------------------------------------------------------

API_BODY = {**LLAMA_70B, "micro_batch": 1, "gpus": 64, "gpus_per_node": 8, "gpu_mem_gb": 80}


@pytest.fixture
def api(make_team, make_user, token_for):
    user = make_user("pia", team=make_team("llm"))
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {token_for(user)}")
    return client


@pytest.mark.django_db
def test_api_plans_the_same_as_the_library(api):
    response = api.post("/api/v1/plan/", API_BODY, format="json")
    assert response.status_code == 200, response.content
    body = response.json()
    expected = plan(ModelShape(**LLAMA_70B), ClusterShape(gpus=64)).to_dict()
    # The API adds the step-time model's figures (test below) to the planner's own.
    assert body["recommended"].pop("predicted_step")["total_s"] > 0
    assert body["recommended"] == expected["recommended"]
    assert len(body["layouts"]) == len(expected["layouts"])


@pytest.mark.django_db
def test_api_adds_each_layouts_step_time_and_the_layout_auto_takes(api):
    """Beside the traffic-ordered recommendation, the step-time model's figures and the
    choice `--layout auto` makes (trainer/layout.choose) for the same shape."""
    body = api.post("/api/v1/plan/", API_BODY, format="json").json()
    model, cluster = ModelShape(**LLAMA_70B), ClusterShape(gpus=64)
    result = plan(model, cluster)
    for entry, layout in zip(body["layouts"], result.layouts, strict=True):
        expected = step_time(model, cluster, layout, H100_NODE)
        assert entry["predicted_step"]["total_s"] == pytest.approx(expected.total_s)
    best, reasons = choose(model, cluster, H100_NODE)
    fastest = body["fastest"]
    assert (fastest["dp"], fastest["tp"], fastest["pp"], fastest["zero"]) == (
        best.dp, best.tp, best.pp, best.zero,
    )  # fmt: skip
    assert body["fastest_reasons"] == reasons
    assert fastest["stages_per_rank"] == best.stages_per_rank
    assert fastest["description"] == best.describe()  # what the CLI and the submit page print
    assert body["hardware"]["name"] == H100_NODE.name
    # It is the fastest fitting runnable layout, up to the near-tie rule.
    fitting = [
        e["predicted_step"]["total_s"]
        for e, layout in zip(body["layouts"], result.layouts, strict=True)
        if layout.fits and runnable(layout)
    ]
    assert fastest["predicted_step"]["total_s"] <= NEAR_TIE * min(fitting)
    # Nothing fits on one GPU: no choice, and the reason.
    none = api.post("/api/v1/plan/", {**API_BODY, "gpus": 8}, format="json").json()
    assert none["fastest"] is None and "no layout of 8 ranks fits" in none["fastest_reasons"][0]


@pytest.mark.django_db
def test_api_accepts_params_written_as_a_float(api):
    response = api.post("/api/v1/plan/", {**API_BODY, "params": 7e10}, format="json")
    assert response.status_code == 200, response.content
    assert response.json()["model"]["params"] == 70 * 10**9


@pytest.mark.django_db
@pytest.mark.parametrize(
    "change, field",
    [
        ({"hidden": 8190}, "hidden"),
        ({"gpus": 12}, "gpus"),
        ({"gpus": 0}, "gpus"),
        ({"dtype": "fp8"}, "dtype"),
        ({"layers": "many"}, "layers"),
        ({"params": 10}, "params"),
    ],
)
def test_api_bad_input_is_a_400_on_its_field(api, change, field):
    response = api.post("/api/v1/plan/", {**API_BODY, **change}, format="json")
    assert response.status_code == 400
    assert field in response.json()
    assert response.json()[field]


@pytest.mark.django_db
def test_api_missing_fields_are_each_named(api):
    response = api.post("/api/v1/plan/", {"gpus": 8}, format="json")
    assert response.status_code == 400
    assert {"layers", "hidden", "heads", "vocab", "seq"} <= set(response.json())


@pytest.mark.django_db
def test_api_needs_authentication():
    response = APIClient().post("/api/v1/plan/", API_BODY, format="json")
    assert response.status_code in (401, 403)


@pytest.mark.django_db
def test_submit_page_offers_the_model_shape_check(client, make_team, make_user):
    user = make_user("quinn", team=make_team("ml"))
    client.force_login(user)
    page = client.get("/jobs/new/").content.decode()
    assert 'id="planner"' in page and 'data-url="/api/v1/plan/"' in page
    assert "portal/planner.js" in page
    # The check lives outside the job form: its inputs are never submitted with the job.
    job_form_end = page.index("</form>")
    assert page.index('id="planner-form"') > job_form_end
    assert finders.find("portal/planner.js")


@pytest.mark.browser
@pytest.mark.django_db(transaction=True)
def test_submit_page_shows_the_recommended_layout_in_the_browser(
    live_server, make_team, make_user, settings
):
    """planner.js in headless Chromium: the job's GPU count and the shape go to the API and the
    recommendation comes back into the page; a bad shape shows the API's field message."""
    import os
    import shutil
    from pathlib import Path

    chromium = shutil.which("chromium") or "/usr/bin/chromium"
    if not Path(chromium).exists():
        pytest.skip("Debian's chromium is not installed (apt-get install chromium)")
    os.environ.setdefault("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    from playwright.sync_api import sync_playwright

    make_user("rio", team=make_team("vision"))
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=chromium,
            args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"],
        )
        try:
            page = browser.new_page()
            page.set_default_timeout(20_000)
            page.goto(f"{live_server.url}/login/")
            page.fill("input[name=username]", "rio")
            page.fill("input[name=password]", "pw-rio")
            page.click("main button[type=submit]")
            page.goto(f"{live_server.url}/jobs/new/")
            page.fill("#id_gpus", "8")
            page.click("#planner summary")
            page.fill("#plan-params", "6.74e9")
            page.click("#planner-check")
            fits = page.wait_for_selector("#planner-result .planner-fits")
            assert "dp=8 tp=1 pp=1 ZeRO-2" in fits.inner_text()
            fastest = page.wait_for_selector("#planner-result .planner-fastest").inner_text()
            assert "what layout auto takes" in fastest and "step" in fastest
            page.fill("#plan-hidden", "4100")  # not divisible by 32 heads
            page.click("#planner-check")
            error = page.wait_for_selector("#planner-result .errorlist li")
            assert "hidden" in error.inner_text() and "not divisible" in error.inner_text()
            # The job form itself is untouched and still submits on its own.
            assert page.input_value("#id_gpus") == "8"
        finally:
            browser.close()
