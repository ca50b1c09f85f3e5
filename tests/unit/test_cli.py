"""The CLI's own argument checks (no stack needed: they run before anything connects)."""

from typer.testing import CliRunner

from services.cli.main import app


def test_submit_refuses_a_task_or_source_the_submit_event_cannot_carry(tmp_path):
    (tmp_path / "a.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    runner = CliRunner()
    res = runner.invoke(app, ["submit", "--task", "x" * 65, str(tmp_path)])
    assert res.exit_code == 2 and "--task must be 1 to 64 characters, not 65" in res.output
    res = runner.invoke(app, ["submit", "--source", "", str(tmp_path)])
    assert res.exit_code == 2 and "--source must be 1 to 64 characters, not 0" in res.output
