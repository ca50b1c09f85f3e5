"""The README's configuration table matches the settings classes."""

import subprocess
import sys

from tests.conftest import REPO


def test_settings_table_is_current():
    res = subprocess.run([sys.executable, "scripts/settings_table.py", "--check", "README.md"], cwd=REPO,
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
