"""The README's configuration table matches the settings classes."""

import os
import subprocess
import sys

from tests.conftest import REPO


def test_settings_table_is_current():
    # PYTHONPATH: this checkout's settings classes, even where the installed (editable) package is another's
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    res = subprocess.run([sys.executable, "scripts/settings_table.py", "--check", "README.md"], cwd=REPO,
                         capture_output=True, text=True, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
