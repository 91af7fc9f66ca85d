"""Metadata lives in pyproject.toml; this only records the git commit in built packages."""

import importlib.util
import json
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

_HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("_embbench_buildinfo", _HERE / "embbench" / "buildinfo.py")
buildinfo = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(buildinfo)


class BuildPyWithCommit(build_py):
    """build_py, then ``embbench/_build_info.json`` with the commit of the checkout it builds
    (or ``EMBBENCH_GIT_COMMIT``); nothing for an editable install, which reads its checkout
    at run time."""

    def run(self):
        super().run()
        info = buildinfo.at_build(_HERE)
        if info and not getattr(self, "editable_mode", False):
            target = Path(self.build_lib) / "embbench" / buildinfo.RECORD
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(json.dumps(info))


setup(cmdclass={"build_py": BuildPyWithCommit})
