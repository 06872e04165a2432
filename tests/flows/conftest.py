import pytest


@pytest.fixture(scope="session", autouse=True)
def prefect_harness():
    """One temporary Prefect server (SQLite) for every flow test in the session."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield
