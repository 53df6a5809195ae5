"""Installs the one-line startup hook `specforge-csbp-hook.pth` next to the package (site-packages root).

Everything else is in pyproject.toml. The hook makes `specforge train --csbp` reach this plugin without
patching SpecForge's files; docs/specforge.md explains it and `SPECFORGE_CSBP_DISABLE=1` switches it off.
"""

import os

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

PTH = "specforge-csbp-hook.pth"
SRC = os.path.join("specforge_csbp", "plugin", PTH)


class BuildPyWithHook(build_py):
    def run(self):
        super().run()
        self.copy_file(SRC, os.path.join(self.build_lib, PTH), preserve_mode=0)

    def get_outputs(self, include_bytecode=1):
        return [*super().get_outputs(include_bytecode), os.path.join(self.build_lib, PTH)]


class EditableWheelWithHook(editable_wheel):
    def _run_build_commands(self, dist_name, unpacked_wheel, build_lib, tmp_dir):
        result = super()._run_build_commands(dist_name, unpacked_wheel, build_lib, tmp_dir)
        self.copy_file(SRC, os.path.join(unpacked_wheel, PTH), preserve_mode=0)
        return result


setup(cmdclass={"build_py": BuildPyWithHook, "editable_wheel": EditableWheelWithHook})
