"""flows.prefect_server: the trainer's private temporary Prefect server, a real server process.

Its idle loop services are off (IDLE_SERVICES), read back from the server's own settings
(`GET /api/admin/settings`); the services that record a run stay on, so a flow's task run is
in the server's database and its state is Completed; a setting in the environment wins."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from flows import prefect_server


@pytest.fixture
def no_api_url(monkeypatch):
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    prefect_server.stop()
    yield monkeypatch
    prefect_server.stop()


def services(url: str) -> dict[str, object]:
    settings = httpx.get(f"{url}/admin/settings", timeout=10).json()
    return {name: value.get("enabled") for name, value in settings["server"]["services"].items()}


def test_the_private_server_runs_without_idle_services_and_records_task_runs(no_api_url):
    from prefect import flow, get_client, task

    @task
    def double(x: int) -> int:
        return 2 * x

    @flow
    def tiny() -> int:
        return double(21)

    with prefect_server.temporary_server() as url:
        enabled = services(url)
        assert {name.lower(): False for name in prefect_server.IDLE_SERVICES}.items() <= enabled.items()
        assert enabled["task_run_recorder"] is True and enabled["event_persister"] is True
        state = tiny(return_state=True)
        assert state.is_completed() and state.result() == 42

        async def task_runs():
            from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

            async with get_client() as client:
                return await client.read_task_runs(
                    flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[state.state_details.flow_run_id])))

        deadline = time.monotonic() + 30  # the recorder writes task runs from their events, in batches
        while not (runs := asyncio.run(task_runs())) or runs[0].state_type.value != "COMPLETED":
            assert time.monotonic() < deadline, f"task run not recorded as completed: {runs}"
            time.sleep(0.5)
        assert [r.name.split("-")[0] for r in runs] == ["double"]


def test_a_service_setting_in_the_environment_wins(no_api_url):
    no_api_url.setenv("PREFECT_SERVER_SERVICES_SCHEDULER_ENABLED", "true")
    with prefect_server.temporary_server() as url:
        enabled = services(url)
    assert enabled["scheduler"] is True and enabled["late_runs"] is False
